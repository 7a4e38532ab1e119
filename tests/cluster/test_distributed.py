"""Who joins a multi-process run, and how the watchdog names a lost peer (no jax needed)."""

import io
import re

import pytest

from holmes_jax.cluster.detect import resolve
from holmes_jax.cluster.watchdog import FAILED_EXIT, NONFINITE_REASON, PEER_LOST_EXIT, Watchdog
from holmes_jax.core.config import load_config
from holmes_jax.core.errors import NONFINITE_EXIT, ConfigError
from holmes_jax.train import main

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "node[01-04]",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
}


def cfg(*overrides):
    return load_config(None, list(overrides))


# --------------------------------------------------------------------------- resolve


def test_single_process_by_default_and_when_asked():
    assert resolve(cfg(), {}) is None
    assert resolve(cfg("distributed.num_processes=1"), SLURM) is None


def test_explicit_settings_skip_cluster_detection():
    s = resolve(
        cfg(
            "distributed.coordinator_address=10.0.0.1:1234",
            "distributed.num_processes=4",
            "distributed.process_id=3",
        ),
        {},
    )
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("10.0.0.1:1234", 4, 3)
    assert s.source == "explicit" and not s.detect and s.local_device_ids is None


def test_incomplete_explicit_settings_name_the_missing_key():
    with pytest.raises(ConfigError, match=r"distributed.process_id \(--process-id\)=None"):
        resolve(cfg("distributed.coordinator_address=h:1", "distributed.num_processes=2"), {})
    with pytest.raises(ConfigError, match=r"distributed.num_processes \(--num-processes\)"):
        resolve(cfg(), {"JAX_COORDINATOR_ADDRESS": "h:1"})


def test_slurm_one_task_per_node_keeps_every_local_device():
    s = resolve(cfg(), SLURM)
    assert s.source == "slurm" and (s.num_processes, s.process_id) == (4, 2)
    assert s.coordinator_address is None  # jax derives it from the node list and job id
    assert s.local_device_ids == [] and s.detect
    per_gpu = resolve(cfg(), {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "8(x2)"})
    assert per_gpu.local_device_ids is None  # jax gives each task its SLURM_LOCALID GPU
    assert resolve(cfg(), {**SLURM, "SLURM_NTASKS": "1"}) is None


def test_slurm_fills_what_the_flags_leave_out():
    s = resolve(cfg("distributed.coordinator_address=node01:9999"), SLURM)
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("node01:9999", 4, 2)


def test_open_mpi_and_kubernetes_detection(monkeypatch):
    ompi = {
        "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1:34911",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
    }
    s = resolve(cfg(), ompi)
    assert (s.source, s.num_processes, s.process_id, s.local_device_ids) == ("ompi", 2, 1, [])
    k8s = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3"}
    import builtins

    real_import = builtins.__import__

    def no_kubernetes(name, *args, **kwargs):
        if name == "kubernetes":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kubernetes)
    assert resolve(cfg(), k8s) is None  # without the package jax cannot detect the Job


def test_process_id_flag_out_of_range_is_a_one_line_error(capsys):
    code = main(["--num-processes", "2", "--process-id", "5", "--set", "train.steps=1"])
    assert code == 2
    err = capsys.readouterr().err
    assert err == "error: distributed.process_id=5: must be < distributed.num_processes=2\n"


# --------------------------------------------------------------------------- watchdog


class FakeStore:
    """The coordination service's key-value store, shared by several fake processes."""

    def __init__(self):
        self.data = {}
        self.down = False

    def client(self):
        store = self

        class Client:
            def key_value_set(self, key, value, allow_overwrite=False):
                if store.down:
                    raise RuntimeError("UNAVAILABLE: Socket closed")
                store.data[key] = value

            def key_value_dir_get(self, prefix):
                if store.down:
                    raise RuntimeError("UNAVAILABLE: Socket closed")
                return [(k, v) for k, v in store.data.items() if k.startswith(prefix)]

        return Client()


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def job(n, timeout=10.0):
    store, clock, exits = FakeStore(), Clock(), []
    dogs = [
        Watchdog(
            store.client(),
            p,
            n,
            timeout_s=timeout,
            label=f"process {p} (host h{p})",
            coordinator="10.0.0.1:1234",
            interval_s=0.01,
            exit=exits.append,
            clock=clock,
            stream=io.StringIO(),
        )
        for p in range(n)
    ]
    for d in dogs:
        d._set(f"label/{d.process_id}", d.label)  # what start() publishes
    return store, clock, dogs, exits


def beat(dogs, seconds, clock, alive=None):
    for _ in range(int(seconds)):
        clock.t += 1
        for d in dogs:
            if alive is None or d.process_id in alive:
                d.beat()


def test_all_alive_no_verdict():
    _, clock, dogs, _ = job(3)
    beat(dogs, 30, clock)
    assert [d.verdict() for d in dogs] == [None, None, None]


def test_a_silent_peer_is_named_after_the_timeout():
    _, clock, dogs, _ = job(4)
    beat(dogs, 3, clock)
    beat(dogs, 9, clock, alive={0, 1, 3})
    assert dogs[0].verdict() is None  # 9 s of silence < 10 s
    beat(dogs, 2, clock, alive={0, 1, 3})
    for p in (0, 1, 3):
        assert re.fullmatch(
            r"lost peer process 2 \(host h2\): no heartbeat for 1[01] s", dogs[p].verdict()
        )


def test_a_victim_that_raised_first_is_not_blamed():
    """Process 1 dies; 3's collective fails at once (it publishes 'failing' and keeps
    beating): everyone still names 1, the one that went silent."""
    store, clock, dogs, _ = job(4)
    beat(dogs, 2, clock)
    dogs[3]._set("failing/3", "1")
    beat(dogs, 12, clock, alive={0, 2, 3})
    for p in (0, 2, 3):
        assert dogs[p].verdict().startswith("lost peer process 1 (host h1): no heartbeat")


def test_a_peer_own_error_is_reported_at_once():
    _, clock, dogs, _ = job(2)
    dogs[1].publish_failure("RESOURCE_EXHAUSTED: out of memory")
    beat(dogs, 1, clock)
    assert dogs[0].verdict() == (
        "peer process 1 (host h1) failed: RESOURCE_EXHAUSTED: out of memory"
    )


def test_finished_peers_are_not_lost():
    _, clock, dogs, _ = job(2)
    beat(dogs, 1, clock)
    dogs[1].close(done=True)
    beat(dogs, 30, clock, alive={0})
    assert dogs[0].verdict() is None


def test_losing_the_coordinator_is_named():
    store, clock, dogs, _ = job(3)
    beat(dogs, 2, clock)
    store.down = True
    beat(dogs, 11, clock, alive={1, 2})
    assert dogs[1].verdict() == (
        "lost the coordinator, process 0 (host h0) at 10.0.0.1:1234: no answer for 11 s "
        "(UNAVAILABLE: Socket closed)"
    )


def test_the_judge_prints_one_line_and_exits(monkeypatch):
    _, clock, dogs, exits = job(2, timeout=0.05)
    d = dogs[1]
    d.beat()  # reads the labels
    d._clock = __import__("time").monotonic
    d._changed = {0: d._clock()}
    d._contact = d._clock() + 3600  # the store answers; only process 0 is silent
    d._judge_loop()
    assert exits == [PEER_LOST_EXIT]
    assert d._stream.getvalue().startswith("error: lost peer process 0 (host h0): no heartbeat")


def test_a_peer_stopped_by_non_finite_steps_ends_the_others_with_its_exit_code():
    """Every process stops after the same step; one that learns it from the store first
    exits 4 too, so the supervisor sees 4 (not retried), not a lost peer's 3."""
    _, clock, dogs, exits = job(2)
    dogs[1].abort(f"{NONFINITE_REASON}step 5: 6 consecutive non-finite steps", exit_code=4)
    beat(dogs, 1, clock)
    dogs[0]._judge_loop()
    assert exits == [NONFINITE_EXIT]
    assert dogs[0]._stream.getvalue() == (
        "error: peer process 1 (host h1) failed: NonFiniteError: step 5: 6 consecutive "
        "non-finite steps\n"
    )


def test_fail_owns_up_when_every_peer_raised_too():
    _, clock, dogs, _ = job(2)
    dogs[0]._set("failing/0", "1")
    beat(dogs, 1, clock)
    assert dogs[1].fail(ValueError("same bug everywhere")) == FAILED_EXIT
    assert dogs[1]._stream.getvalue() == (
        "error: process 1 (host h1) failed: same bug everywhere\n"
    )
    beat(dogs, 1, clock, alive={0})
    assert dogs[0].verdict() == "peer process 1 (host h1) failed: same bug everywhere"


def test_a_lost_coordinator_service_names_process_0_at_once():
    """jax's client lost the service (process 0's sockets closed): no waiting for a timeout."""
    import socket

    from holmes_jax.cluster.launcher import free_port

    _, clock, dogs, exits = job(3)
    beat(dogs, 2, clock)
    dogs[1].coordinator = f"127.0.0.1:{free_port()}"  # nobody listens: process 0 is gone
    dogs[1].coordinator_lost()
    assert exits == [PEER_LOST_EXIT]
    assert dogs[1]._stream.getvalue() == (
        f"error: lost peer process 0 (host h0): the coordination service it held at "
        f"{dogs[1].coordinator} is gone\n"
    )
    dogs[1].coordinator_lost()  # a second client thread: no second line
    assert dogs[1]._stream.getvalue().count("\n") == 1

    with socket.create_server(("127.0.0.1", 0)) as server:  # the coordinator still answers
        dogs[2].coordinator = f"127.0.0.1:{server.getsockname()[1]}"
        dogs[2].coordinator_lost()
    assert dogs[2]._stream.getvalue() == (
        "error: process 2 (host h2): jax's coordination service reported an error before any "
        "peer was found lost (its log line above says which)\n"
    )


def test_a_known_verdict_wins_over_a_lost_coordinator():
    _, clock, dogs, exits = job(2)
    dogs[0].publish_failure("ValueError: bad batch")  # then process 0 exits, taking the store
    beat(dogs, 1, clock)
    dogs[1].coordinator_lost()
    assert dogs[1]._stream.getvalue() == (
        "error: peer process 0 (host h0) failed: ValueError: bad batch\n"
    )
