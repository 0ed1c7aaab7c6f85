"""`distributed.HostGroup` against a real coordination service (jax's, in this process, one client
per simulated host, each host on its own thread): the values every host gets back, the reads
each round costs, the keys left behind, and a wait that ends the run naming the silent host."""
import collections
import threading

import pytest
from jax._src.lib import _jax

from mars_jax import distributed
from tests.distributed.processes import free_port

READS = ("blocking_key_value_get", "key_value_dir_get", "key_value_try_get")


class Counted:
    """A coordination service client that counts the calls made through it, by method."""

    def __init__(self, client):
        self.client, self.calls = client, collections.Counter()

    def __getattr__(self, method):
        self.calls[method] += 1
        return getattr(self.client, method)


def _together(functions) -> list:
    """Each of `functions` run on its own thread; their results, in order."""
    results, errors = [None] * len(functions), []

    def run(i):
        try:
            results[i] = functions[i]()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(functions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def clients(request):
    """`request.param` clients of one fresh coordination service, connected."""
    count, address = request.param, f"localhost:{free_port()}"
    service = _jax.get_distributed_runtime_service(f"[::]:{address.rsplit(':')[1]}", count)
    made = [_jax.get_distributed_runtime_client(address, i, init_timeout=30) for i in range(count)]
    _together([client.connect for client in made])
    yield made
    _together([client.shutdown for client in made])
    service.shutdown()


@pytest.mark.parametrize("clients", [3], indirect=True)
def test_each_host_reads_once_a_round_and_the_rounds_before_are_deleted(clients):
    counted = [Counted(client) for client in clients]
    groups = [distributed.HostGroup("test", 60, client=c, process=i, processes=3)
              for i, c in enumerate(counted)]
    rounds = 5

    def host(i):
        return [groups[i].gather({"host": i, "round": r}) for r in range(rounds)]

    for i, got in enumerate(_together([lambda i=i: host(i) for i in range(3)])):
        assert got == [[{"host": h, "round": r} for h in range(3)] for r in range(rounds)], i
    for c in counted:  # one read a round, plus the attempt's token at the first
        assert sum(c.calls[m] for m in READS) == rounds + 1, c.calls
        assert c.calls["key_value_set"] + c.calls["key_value_increment"] >= 2 * rounds
    prefix = groups[0]._prefix
    assert prefix == groups[2]._prefix and prefix.startswith(distributed.EXCHANGE_KEYS + "/")
    left = sorted(key for key, _ in clients[0].key_value_dir_get(prefix + "/"))
    assert left == [f"{prefix}/{rounds - 1}/all", f"{prefix}/{rounds - 1}/count"]
    # a second group of the same name keeps its rounds apart from the first's
    again = [distributed.HostGroup("test", 60, client=c, process=i, processes=3)
             for i, c in enumerate(clients)]
    assert _together([lambda i=i: again[i].gather(i * 10) for i in range(3)]) == [[0, 10, 20]] * 3


@pytest.mark.parametrize("clients", [2], indirect=True)
def test_a_host_that_does_not_answer_ends_the_run_naming_it(clients, monkeypatch, caplog):
    ended = []

    def end_run(message):
        ended.append(message)
        raise SystemExit(1)

    monkeypatch.setattr(distributed, "end_run", end_run)
    groups = [distributed.HostGroup("silent", 1.0, log_every_s=0.3, client=c, process=i,
                                    processes=2) for i, c in enumerate(clients)]
    assert _together([lambda i=i: groups[i].gather(i) for i in range(2)]) == [[0, 1]] * 2
    with pytest.raises(SystemExit):
        groups[0].gather("alone")  # host 1 never comes to round 1
    assert len(ended) == 1
    assert "host exchange 'silent' round 1" in ended[0] and "hosts [1] did not answer" in ended[0]
    assert any("waiting" in r.message and "[1]" in r.message for r in caplog.records)
