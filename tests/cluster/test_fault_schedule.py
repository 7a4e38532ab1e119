"""The seeded random fault schedule: reproducible from its seed, faults where their kind
says, about ``steps / mtbf_steps`` of them, and flags the launcher parses."""

import statistics

import pytest

from holmes_jax.cluster import fault_schedule, linkcut
from holmes_jax.cluster.supervisor import parse_fault
from holmes_jax.core.errors import ConfigError

HOSTS = ("ib-1", "roce-0", "roce-1")


def schedule(seed, steps=200, mtbf=50.0, every=5, **kw):
    return fault_schedule.draw(seed, steps, mtbf, HOSTS, every, away_s=25, cut_s=20, **kw)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    assert schedule(7) == schedule(7)
    assert fault_schedule.flags(schedule(7)) == fault_schedule.flags(schedule(7))
    assert len({tuple(schedule(s)) for s in range(20)}) > 15


def test_faults_sit_where_their_kind_says():
    kinds = set()
    for seed in range(200):
        faults = schedule(seed)
        steps = [f.step for f in faults]
        assert steps == sorted(set(steps)) and all(1 <= s < 200 for s in steps)
        assert sum(f.kind == "cut" for f in faults) <= 1  # the launcher takes one cut
        for f in faults:
            kinds.add(f.kind)
            if f.kind == "checkpoint":
                assert f.step % 5 == 0
            if f.kind == "cut":
                assert f.host is None and f.seconds == 20
            else:
                assert f.host in HOSTS and f.seconds == (25 if f.kind == "away" else 0)
    assert kinds == set(fault_schedule.KINDS)


def test_about_steps_over_mtbf_faults_a_run():
    counts = [len(schedule(seed, steps=1000, mtbf=100.0, kinds=("kill",))) for seed in range(300)]
    assert statistics.mean(counts) == pytest.approx(10, rel=0.1)
    assert len(schedule(0, steps=1000, mtbf=1e9)) == 0


def test_the_flags_are_what_the_launcher_parses():
    faults = [f for seed in range(50) for f in schedule(seed)]
    for f in faults:
        flag, spec = f.flags()
        if f.kind == "cut":
            assert flag == "--cut-islands"
            assert linkcut.parse_cut(spec) == linkcut.Cut(f.step, f.seconds, spec)
        else:
            assert flag == "--fail-host"
            got = parse_fault(spec, HOSTS)
            assert (got.host, got.step, got.away_s) == (f.host, f.step, f.seconds)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"mtbf": 0}, r"--mtbf-steps=0: must be a number of steps > 0"),
        ({"every": 0}, r"checkpoint.every=0: must be >= 1"),
        ({"kinds": ("kill", "flood")}, r"fault kinds \['kill', 'flood'\]: each must be one of"),
    ],
)
def test_bad_parameters_are_one_line(change, match):
    with pytest.raises(ConfigError, match=match):
        schedule(0, **change)
