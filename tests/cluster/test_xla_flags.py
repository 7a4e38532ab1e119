"""XLA flag validation: unknown flags abort XLA, so they are filtered out before use."""

from holmes_jax.cluster import xla_flags


def test_unknown_flags_are_dropped_known_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    good = "--xla_gpu_enable_latency_hiding_scheduler=true"
    bad = "--xla_holmes_no_such_flag=1"
    assert xla_flags.accepted_flags([good, bad]) == [good]
    assert xla_flags.cached_accepted_flags([good]) == [good]
    assert (tmp_path / "holmes_jax" / "xla_flags.json").exists()


def test_no_gpu_means_no_flags(monkeypatch):
    monkeypatch.setattr(xla_flags, "gpu_present", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert xla_flags.apply_gpu_flags() == []


def test_gpu_flags_respect_user_settings(monkeypatch):
    monkeypatch.setattr(xla_flags, "gpu_present", lambda: True)
    monkeypatch.setattr(xla_flags, "cached_accepted_flags", lambda flags: list(flags))
    user = "--xla_gpu_enable_latency_hiding_scheduler=false"
    monkeypatch.setenv("XLA_FLAGS", user)
    added = xla_flags.apply_gpu_flags()
    assert user.split("=")[0] not in {f.split("=")[0] for f in added}
    import os

    assert os.environ["XLA_FLAGS"].startswith(user)
