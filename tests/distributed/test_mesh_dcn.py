"""Within-slice and across-slice (dcn) mesh sizes."""
import pytest

from mars_jax import sharding


def test_dcn_sizes_multiply_within_slice_sizes():
    config = sharding.MeshConfig.from_mapping({"data": 1, "fsdp": -1, "dcn": {"data": 2}})
    assert config.dcn == (2, 1, 1, 1)
    assert config.num_slices == 2
    assert config.resolve(16) == (2, 8, 1, 1)
    assert config.resolve_ici(8) == (1, 8, 1, 1)


def test_mesh_without_dcn_is_unchanged():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 1, "expert": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 1, "expert": 2}


@pytest.mark.parametrize("bad, message", [
    ({"dcn": {"dat": 2}}, r"mesh.dcn: unknown axes \['dat'\]"),
    ({"dcn": {"data": 0}}, "mesh.dcn.data: size must be positive"),
    ({"data": -1, "dcn": {"data": 3}}, "8 devices cannot form 3 equal slices"),
    ({"data": -1, "dcn": {"data": 2}}, "need 2 slices, but the devices span 1 processes"),
])
def test_dcn_errors_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(bad)
