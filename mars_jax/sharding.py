"""One named mesh and the logical-axis rules that place parameters and activations on it.

`constrain` is a no-op outside a mesh, so the same model code runs on one device or a pod. Axes are
`AxisType.Auto`: the rules feed `with_sharding_constraint` and `jit` shardings.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# Logical name -> mesh axes (None = replicated). Parameters: 'embed' is FSDP-sharded, heads / mlp /
# vocab are tensor-parallel, experts are expert-parallel. Activations: the batch spreads over every
# axis that holds distinct data ('data', 'fsdp' and 'expert'), heads and mlp over 'tensor'.
# MoE expert weights take 'fsdp' on their experts dimension where it divides it (else on 'embed'):
# the update gathers them over 'fsdp' either way, and a decode step then runs each expert on the
# chip that holds it instead of gathering every expert to every chip.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", ("expert", "fsdp")),
    ("norm", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("cache_length", None),
)

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes within one slice, one of them may be -1 (the remaining devices);
    `dcn`, in `MESH_AXES` order, how many slices (on GPU and CPU: processes) each axis spans.
    `field` is the config section error messages name."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    dcn: tuple[int, ...] = (1,) * len(MESH_AXES)
    field: str = dataclasses.field(default="mesh", compare=False)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], field: str = "mesh") -> "MeshConfig":
        """Axis sizes by name, plus an optional `dcn` mapping of across-slice sizes by name."""
        mapping = dict(mapping)
        dcn = dict(mapping.pop("dcn", None) or {})
        for where, names in ((field, mapping), (f"{field}.dcn", dcn)):
            unknown = set(names) - set(MESH_AXES)
            if unknown:
                raise ValueError(f"{where}: unknown axes {sorted(unknown)}; "
                                 f"valid axes are {MESH_AXES}")
        for name, size in dcn.items():
            if int(size) < 1:
                raise ValueError(f"{field}.dcn.{name}: size must be positive, got {size}")
        return cls(**{k: int(v) for k, v in mapping.items()},
                   dcn=tuple(int(dcn.get(name, 1)) for name in MESH_AXES), field=field)

    @property
    def num_slices(self) -> int:
        return math.prod(self.dcn)

    def resolve(self, num_devices: int) -> tuple[int, ...]:
        """Full axis sizes (within-slice times `dcn`) with -1 replaced; raises ValueError naming
        the field when they do not fit `num_devices`."""
        if num_devices % self.num_slices:
            raise ValueError(f"{self.field}.dcn: {num_devices} devices cannot form "
                             f"{self.num_slices} equal slices "
                             f"(dcn sizes {dict(zip(MESH_AXES, self.dcn))})")
        ici = self.resolve_ici(num_devices // self.num_slices)
        return tuple(i * d for i, d in zip(ici, self.dcn))

    def resolve_ici(self, num_devices: int) -> tuple[int, ...]:
        """Within-slice axis sizes with -1 replaced, for slices of `num_devices` devices."""
        sizes = [getattr(self, name) for name in MESH_AXES]
        wildcard = [name for name, size in zip(MESH_AXES, sizes) if size == -1]
        if len(wildcard) > 1:
            raise ValueError(f"{self.field}: only one axis may be -1, got {wildcard}")
        for name, size in zip(MESH_AXES, sizes):
            if size == 0 or size < -1:
                raise ValueError(f"{self.field}.{name}: size must be positive or -1, got {size}")
        known = math.prod(size for size in sizes if size != -1)
        if wildcard:
            if num_devices % known:
                raise ValueError(
                    f"{self.field}: {num_devices} devices cannot be split with fixed axes of "
                    f"product {known}; set {self.field} sizes whose product divides {num_devices}")
            sizes[MESH_AXES.index(wildcard[0])] = num_devices // known
        elif known != num_devices:
            raise ValueError(
                f"{self.field}: product of axis sizes {dict(zip(MESH_AXES, sizes))} is {known}, "
                f"but {num_devices} devices are available; set one axis to -1 or fix the sizes")
        return tuple(sizes)


def make_mesh(config: MeshConfig | Mapping[str, Any] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The ('data', 'fsdp', 'tensor', 'expert') mesh with Auto axes over `devices`, laid out
    along the physical topology; with `dcn`, each slice holds one within-slice block."""
    if config is None:
        config = MeshConfig()
    elif not isinstance(config, MeshConfig):
        config = MeshConfig.from_mapping(config)
    devices = list(jax.devices() if devices is None else devices)
    shape = config.resolve(len(devices))
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if config.num_slices == 1:
        if slices > 1:
            logging.warning("mesh: devices span %d slices but mesh.dcn is unset, so every axis "
                            "may cross the data-centre network; set mesh.dcn", slices)
        try:
            device_array = mesh_utils.create_device_mesh(shape, devices,
                                                         allow_split_physical_axes=True)
        except (AssertionError, ValueError, NotImplementedError):
            # Not a whole physical block (e.g. 2 chips of every host): devices in their order.
            device_array = np.asarray(devices, dtype=object).reshape(shape)
    else:
        granules = {d.slice_index if slices > 1 else d.process_index for d in devices}
        if len(granules) != config.num_slices:
            kind = "slices" if slices > 1 else "processes"
            raise ValueError(f"{config.field}.dcn: sizes {dict(zip(MESH_AXES, config.dcn))} need "
                             f"{config.num_slices} slices, but the devices span {len(granules)} "
                             f"{kind}")
        ici = config.resolve_ici(len(devices) // config.num_slices)
        device_array = mesh_utils.create_hybrid_device_mesh(
            ici, config.dcn, devices, process_is_granule=slices == 1,
            allow_split_physical_axes=True)
    return Mesh(device_array, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


@dataclasses.dataclass(frozen=True)
class MeshSplit:
    """The config's `mesh` section: training (`train`) and rollout (`rollout`) axis sizes, one
    shared mesh (`rollout_devices == 0`) or the last `rollout_devices` of each host as its own
    rollout mesh. Only a shared training mesh may span slices."""

    train: MeshConfig = MeshConfig()
    rollout: MeshConfig = MeshConfig(field="mesh.rollout")
    rollout_devices: int = 0

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> "MeshSplit":
        """The `mesh` section: axis sizes (and `dcn`) of the training (or shared) mesh, plus an
        optional `rollout` mapping of `devices` and the rollout mesh's axis sizes."""
        mapping = dict(mapping)
        rollout = dict(mapping.pop("rollout", None) or {})
        devices = int(rollout.pop("devices", 0))
        return cls(MeshConfig.from_mapping(mapping),
                   MeshConfig.from_mapping(rollout, field="mesh.rollout"), devices)

    @property
    def split(self) -> bool:
        return self.rollout_devices > 0

    def resolve(self, num_devices: int, processes: int = 1
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Full axis sizes of the training mesh (over every process's devices) and of one rollout
        mesh (over one process's); raises ValueError naming the field when they do not fit
        `num_devices` devices split evenly over `processes` processes."""
        if self.rollout_devices < 0:
            raise ValueError(f"mesh.rollout.devices: must be 0 (one shared mesh) or positive, "
                             f"got {self.rollout_devices}")
        local = num_devices // processes
        if not self.split:
            shape = self.train.resolve(num_devices)
            if processes == 1 and self.rollout == MeshConfig(field="mesh.rollout"):
                return shape, shape
            return shape, self.rollout.resolve(local)
        if self.rollout_devices >= local:
            raise ValueError(f"mesh.rollout.devices: {self.rollout_devices} leaves none of the "
                             f"{local} devices{' per host' if processes > 1 else ''} for training")
        if self.train.num_slices > 1:
            raise ValueError("mesh.dcn: a mesh split into rollout and training submeshes spans "
                             f"one slice; got dcn sizes {dict(zip(MESH_AXES, self.train.dcn))}")
        train_devices = num_devices - self.rollout_devices * processes
        try:
            train = self.train.resolve(train_devices)
        except ValueError as e:
            raise ValueError(f"{e} (training submesh: {num_devices} devices less "
                             f"mesh.rollout.devices={self.rollout_devices}"
                             f"{f' on each of {processes} hosts' if processes > 1 else ''})"
                             ) from None
        return train, self.rollout.resolve(self.rollout_devices)


def make_meshes(split: MeshSplit | Mapping[str, Any],
                devices: Sequence[jax.Device] | None = None,
                process: int | None = None) -> tuple[Mesh, Mesh]:
    """(training mesh, this process's rollout mesh) over `devices` as `MeshSplit` says."""
    if not isinstance(split, MeshSplit):
        split = MeshSplit.from_mapping(split)
    devices = list(jax.devices() if devices is None else devices)
    by_process = devices_by_process(devices)
    split.resolve(len(devices), len(by_process))
    process = jax.process_index() if process is None else process
    own = by_process[process] if len(by_process) > 1 else devices
    if not split.split:
        mesh = make_mesh(split.train, devices)
        if len(by_process) == 1 and split.rollout == MeshConfig(field="mesh.rollout"):
            return mesh, mesh
        return mesh, make_mesh(split.rollout, own)
    cut = len(own) - split.rollout_devices
    train = [d for block in by_process.values() for d in block[:len(block) - split.rollout_devices]]
    return make_mesh(split.train, train), make_mesh(split.rollout, own[cut:])


def devices_by_process(devices: Sequence[jax.Device]) -> dict[int, list[jax.Device]]:
    """`devices` grouped by process, in order; ValueError when the groups' sizes differ."""
    groups: dict[int, list[jax.Device]] = {}
    for device in devices:
        groups.setdefault(getattr(device, "process_index", 0), []).append(device)
    if len({len(group) for group in groups.values()}) > 1:
        raise ValueError(f"mesh: processes hold different numbers of devices "
                         f"{ {p: len(g) for p, g in groups.items()} }")
    return dict(sorted(groups.items()))


class _Active(threading.local):
    rules: Rules = DEFAULT_RULES


_ACTIVE = _Active()


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[Mesh]:
    """Makes `mesh` and `rules` current for :func:`constrain` and jitted code traced inside."""
    previous = _ACTIVE.rules
    _ACTIVE.rules = tuple(rules)
    try:
        with jax.set_mesh(mesh):
            yield mesh
    finally:
        _ACTIVE.rules = previous


def spec_axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (a name, a tuple of names, or None)."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _rule_axes(names: Sequence[str | None], rules: Rules | None) -> list[tuple[str, ...]]:
    """The mesh axes each logical name's rule asks for (the current rules unless `rules`)."""
    table = dict(_ACTIVE.rules if rules is None else rules)
    return [spec_axes(table.get(name) if name is not None else None) for name in names]


def logical_to_spec(names: Sequence[str | None], rules: Rules | None = None) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec; a mesh axis is used at most once."""
    used: set[str] = set()
    spec = []
    for wanted in _rule_axes(names, rules):
        axes = tuple(a for a in wanted if a not in used)
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*spec)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pins activation `x` to the sharding its logical `names` imply; no-op without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, fitted_spec(names, x.shape, mesh))


def fitted_spec(names: Sequence[str | None], shape: Sequence[int], mesh,
                rules: Rules | None = None) -> PartitionSpec:
    """The PartitionSpec of logical `names` for `shape` on `mesh`: per dimension, the axes of its
    rule that no earlier dimension took and that divide it; an axis not taken stays free for the
    next."""
    used: set[str] = set()
    fitted = []
    padded = tuple(names) + (None,) * (len(shape) - len(names))
    for dim, wanted in zip(shape, _rule_axes(padded, rules)):
        kept, size = [], 1
        for axis in wanted:
            if axis not in used and dim % (size * mesh.shape[axis]) == 0:
                kept.append(axis)
                size *= mesh.shape[axis]
        used.update(kept)
        fitted.append(kept[0] if len(kept) == 1 else (tuple(kept) or None))
    return PartitionSpec(*fitted)


def named_sharding(mesh: Mesh, names: Sequence[str | None], shape: Sequence[int],
                   rules: Rules | None = None) -> NamedSharding:
    """The NamedSharding for an array of `shape` with logical axis `names`."""
    return NamedSharding(mesh, fitted_spec(names, shape, mesh, rules))


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules | None = None) -> nnx.State:
    """A NamedSharding per variable in `state` from its `logical_axes`; a mesh axis that does not
    divide its dimension is dropped (replicated), with one warning per variable."""

    def one(path, variable):
        shape = variable.get_value().shape
        names = variable.get_metadata().get("logical_axes") or (None,) * len(shape)
        sharding = named_sharding(mesh, names, shape, rules)
        _warn_dropped(jax.tree_util.keystr(path, simple=True, separator="."), shape, names,
                      sharding.spec, mesh, rules)
        return variable.replace(sharding)

    return jax.tree_util.tree_map_with_path(one, state,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def _warn_dropped(name: str, shape: Sequence[int], names: Sequence[str | None],
                  fitted: PartitionSpec, mesh, rules: Rules | None) -> None:
    """Warns of each mesh axis the rules of `names` ask for that no dimension of `fitted` kept."""
    kept = {axis for entry in fitted for axis in spec_axes(entry)}
    tried: dict[str, list[str]] = {}
    for i, (dim, wanted) in enumerate(zip(shape, _rule_axes(names, rules))):
        for axis in wanted:
            if axis not in kept:
                tried.setdefault(axis, []).append(f"dimension {i} (size {dim})")
    dropped = [f"mesh axis {axis!r} (size {mesh.shape[axis]}) does not divide {' or '.join(dims)}"
               for axis, dims in tried.items()]
    if dropped:
        logging.warning("sharding: parameter %s of shape %s: %s; it is replicated along %s",
                        name, tuple(shape), "; ".join(dropped),
                        "that axis" if len(dropped) == 1 else "those axes")


def fetch(tree):
    """`tree`'s arrays as numpy on this host (a collective where other hosts hold shards)."""
    local = all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree))
    if jax.process_count() == 1 or local:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)
