"""Config loading: strict YAML, typed overrides, one-line errors with exit code 2."""

import glob
import os
import subprocess
import sys

import pytest

from holmes_jax.core.config import Config, config_from_dict, load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import plan_request
from holmes_jax.train import main
from tests.common import ROOT, as_flags


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    with open(path) as f:
        first = f.readline()
    assert first.startswith("#"), f"{path} must open with a comment saying what it is"
    assert "python -m holmes_jax" in open(path).read(), f"{path} must show its command"


def test_overrides_are_typed():
    cfg = load_config(
        None,
        [
            "train.steps=7",
            "optimizer.learning_rate=1e-3",  # YAML 1.1 reads this as a string
            "model.num_layers=4",
            "parallel.stages=2",
            "parallel.layers_per_stage=[1,3]",
            "model.tied_embeddings=false",
            "train.metrics_path=m.jsonl",
        ],
    )
    assert cfg.train.steps == 7
    assert cfg.optimizer.learning_rate == pytest.approx(1e-3)
    assert cfg.parallel.layers_per_stage == (1, 3)
    assert cfg.model.tied_embeddings is False
    assert cfg.train.metrics_path == "m.jsonl"


def test_base_60_numbers_are_text(tmp_path):
    """YAML 1.1 reads 2:2 as 122 and 1:30.5 as 90.5; the configs mean the text (YAML 1.2)."""
    from holmes_jax.core.yamlio import safe_load

    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 10\n  run_dir: r\nlogging:\n  profile_steps: 2:2\n")
    assert load_config(path).logging.profile_steps == "2:2"
    assert safe_load("[2:2, 1:30.5, -3:10, 12, 1_000, 0x10, 1.5, host0:1234]") == [
        "2:2", "1:30.5", "-3:10", 12, 1000, 16, 1.5, "host0:1234"
    ]  # fmt: skip


def test_round_trip_through_dict():
    cfg = load_config(None, ["parallel.stages=2", "parallel.layers_per_stage=[2,2]"])
    assert config_from_dict(cfg.to_dict()) == cfg


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_sise: 64\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert str(err.value) == (
        f"{bad}: unknown key 'hidden_sise' in section model; did you mean 'hidden_size'?"
    )
    bad.write_text("modle:\n  hidden_size: 64\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad, ["train.steps=3"])
    assert str(err.value) == f"{bad}: unknown section 'modle'; did you mean 'model'?"
    bad.write_text("model:\n  num_layers: four\n")
    with pytest.raises(ConfigError, match=r"model.num_layers='four': expected int"):
        load_config(bad)


BAD_CASES = [
    (["model.num_heads=5"], "model.num_heads=5: must divide model.hidden_size=128"),
    (
        ["train.stpes=5"],
        "--set train.stpes=5: unknown key 'stpes' in section train; did you mean 'steps'?",
    ),
    (["trian.steps=5"], "--set trian.steps=5: unknown section 'trian'; did you mean 'train'?"),
    (["model.bogus=1"], "--set model.bogus=1: unknown key 'bogus' in section model; allowed: "),
    (["train.steps=1.5"], "train.steps=1.5: expected int"),
    (["train.steps=0"], "train.steps=0: must be > 0"),
    (
        ["parallel.data=3"],
        "train.global_batch_size=32: must be divisible by parallel.replica*data*microbatches "
        "= 1*3*1 = 3 (each data-parallel rank takes an equal share of each micro-batch)",
    ),
    (["parallel.schedule=zigzag"], "parallel.schedule='zigzag': must be one of gpipe, 1f1b"),
    (["parallel.stages=2", "parallel.layers_per_stage=[1,2]"], "must sum to model.num_layers=4"),
    (
        ["data.source=tokens", "data.path=/no/such/file.bin"],
        "data.path=/no/such/file.bin: no such file or directory; python -m holmes_jax.data "
        "prepare --tokenizer HF_DIR --input TEXT --out /no/such/file.bin writes token shards",
    ),
    (["data.source=text", "data.path=/no/such/dir"], "data.path='/no/such/dir': file does not"),
    (["nodot=1"], "--set nodot=1: key must be section.key"),
    (["model.arch=bert"], "model.arch='bert': must be one of gpt2, llama"),
    (["model.arch=llama", "model.num_kv_heads=3"], "model.num_kv_heads=3: must divide model"),
    (["model.num_kv_heads=2"], "model.num_kv_heads=2: grouped-query attention needs model.arch"),
    (
        ["model.arch=llama", "model.num_kv_heads=2", "parallel.tensor=4"],
        "parallel.tensor=4: must divide model.num_kv_heads=2",
    ),
    (["model.mlp_size=-8"], "model.mlp_size=-8: must be > 0"),
    (
        ["model.vocab_size=50257", "parallel.tensor=2"],
        "parallel.tensor=2: must divide model.vocab_size=50257; set model.vocab_multiple",
    ),
    (
        ["model.vocab_size=50257", "model.vocab_multiple=3", "parallel.tensor=2"],
        "model.vocab_size=50257 padded to 50259 (model.vocab_multiple=3)",
    ),
    (["model.vocab_multiple=0"], "model.vocab_multiple=0: must be > 0"),
    (["model.arch=llama", "model.rope_base=0.5"], "model.rope_base=0.5: must be > 1"),
]


def test_a_padded_vocabulary_splits_over_tensor():
    cfg = load_config(None, ["model.vocab_size=50257", "model.vocab_multiple=128"]).model
    assert not load_config(None, ["model.vocab_multiple=7"]).model.padded_vocab % 7
    assert (cfg.vocab_size, cfg.padded_vocab, cfg.spec.vocab_size) == (50257, 50304, 50304)
    load_config(None, ["model.vocab_size=50257", "model.vocab_multiple=128", "parallel.tensor=4"])
    assert load_config(None, ["model.vocab_size=256"]).model.padded_vocab == 256


def test_arch_defaults_and_explicit_mlp_width():
    gpt2, llama = load_config(None, []).model, load_config(None, ["model.arch=llama"]).model
    assert (gpt2.arch, gpt2.tied_embeddings, gpt2.num_kv_heads, gpt2.mlp_size) == (
        "gpt2", True, 4, 512
    )  # fmt: skip
    assert (llama.tied_embeddings, llama.num_kv_heads, llama.rope_base) == (False, 4, 10000.0)
    tied = load_config(None, ["model.arch=llama", "model.tied_embeddings=true"]).model
    assert tied.tied_embeddings is True
    wide = load_config(None, ["model.arch=llama", "model.mlp_size=344", "model.mlp_ratio=2"])
    assert wide.model.mlp_size == 344 and wide.model.spec.mlp_size == 344  # explicit wins
    assert config_from_dict(wide.to_dict()) == wide  # checkpoint metadata round trip


@pytest.mark.parametrize("overrides,message", BAD_CASES)
def test_bad_config_is_one_line_exit_2(overrides, message, capsys):
    argv = as_flags(overrides)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_device_checks():
    cfg = load_config(None, ["parallel.devices=16"])
    with pytest.raises(
        ConfigError, match=r"parallel.devices=16: more devices asked for than exist"
    ):
        plan_request(cfg).degrees(8)
    cfg = load_config(None, ["train.global_batch_size=12", "parallel.tensor=1"])
    with pytest.raises(ConfigError, match=r"train.global_batch_size=12: must be divisible by"):
        plan_request(cfg).degrees(8)  # data = 8 does not divide 12
    shape = plan_request(load_config(None, ["parallel.tensor=2"])).degrees(8)
    assert (shape.stages, shape.data, shape.tensor) == (1, 4, 2)


def test_cli_exit_code_in_a_fresh_process():
    """The real entry point: too many devices -> one line on stderr, exit 2, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "holmes_jax.train", "--set", "parallel.devices=64"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "parallel.devices=64: more devices asked for than exist (8)" in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- bounds


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.num_layers=1000000000000", "model.num_layers=1000000000000: must be <= 4096"),
        ("model.hidden_size=2**40", "model.hidden_size='2**40': expected int"),
        ("model.hidden_size=1099511627776", "must be <= 262144 (hidden size)"),
        ("train.global_batch_size=1000000000000", "must be <= 1048576 (sequences per step)"),
        ("parallel.microbatches=1000000000000", "must be <= 1048576 (sequences per step)"),
        ("parallel.tensor=100000", "parallel.tensor=100000: must be <= 1024 (devices per host)"),
        ("parallel.replica=1000", "parallel.replica=1000: must be <= 256 (islands per topology)"),
        ("train.eval_batches=10000000", "must be <= 100000 (evaluation batches)"),
        ("train.seed=-1", "train.seed=-1: must be >= 0"),
        ("train.seed=4294967296", "train.seed=4294967296: must be <= 4294967295 (a 32-bit seed)"),
        ("distributed.heartbeat_timeout_s=10000000", "must be <= 1000000 (seconds; jax"),
        ("optimizer.learning_rate=.nan", "optimizer.learning_rate=nan: must be a finite number"),
        ("optimizer.eps=.inf", "optimizer.eps=inf: must be a finite number"),
        ("optimizer.grad_clip=1e999", "optimizer.grad_clip='1e999': must be a finite number"),
        ("optimizer.weight_decay=" + "9" * 400, "optimizer.weight_decay=999999"),
        ('model.remat="a\\nb"', "model.remat='a\\nb': must be one of none, full, selective"),
        ('train.metrics_path="a\\nb"', "train.metrics_path='a\\nb': must be one line of printable"),
        ('train.metrics_path="\\t"', "train.metrics_path='\\t': must be one line of printable"),
        ("model.num_layers=2020-13-45", "model.num_layers='2020-13-45': expected int"),
        ("model.num_layers=" + "[" * 5000, "model.num_layers='[[[[[[["),
    ],
)
def test_sizes_are_bounded_and_numbers_finite(override, message):
    # load_config, not train's main: were a check missing, main would train.
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_files_no_parser_accepts_are_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    for text, message in [
        (b"model: {num_layers: 2020-13-45}\n", "not valid YAML (ValueError: month must be"),
        (b"[" * 100_000, "nesting: must be <= 100 (levels of YAML nesting)"),
        (b"model:\n  \xff\xfe: 1\n", "cannot be read"),
        (b"model: {1: 2, x: 3}\n", "unknown key '1' in section model; allowed: arch"),
        (b"model: {num_layers: &a [*a, *a]}\n", "model.num_layers=[[[[...], [...]], [[...],"),
    ]:
        path.write_bytes(text)
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert "\n" not in str(err.value) and message in str(err.value), str(err.value)


def test_a_mistyped_override_names_the_override_not_the_file(tmp_path):
    """The file is fine; the --set is wrong: the message names the --set."""
    good = tmp_path / "good.yaml"
    good.write_text("train:\n  steps: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(good, ["train.global_bach_size=8"])
    assert str(err.value) == (
        "--set train.global_bach_size=8: unknown key 'global_bach_size' in section train; "
        "did you mean 'global_batch_size'?"
    )


def test_one_batch_rule_one_message():
    """The config check, the device check and the planner's layout share one rule."""
    from holmes_jax.core.spec import Layout

    rule = (
        "train.global_batch_size={b}: must be divisible by parallel.replica*data*microbatches "
        "= {r}*{d}*{m} = {n} (each data-parallel rank takes an equal share of each micro-batch)"
    )
    cfg = load_config(None, ["parallel.microbatches=3", "parallel.replica=2"])
    with pytest.raises(ConfigError) as err:
        plan_request(cfg).degrees(8)  # data = 4
    assert str(err.value) == rule.format(b=32, r=2, d=4, m=3, n=24)
    with pytest.raises(ConfigError) as err:
        Layout(1, 4, 1, replica=2, microbatches=3).microbatch_size(32)
    assert str(err.value) == rule.format(b=32, r=2, d=4, m=3, n=24)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["parallel.data=2", "parallel.microbatches=5"])
    assert str(err.value) == rule.format(b=32, r=1, d=2, m=5, n=10)
    assert Layout(1, 4, 1, replica=2, microbatches=2).microbatch_size(32) == 2
