"""Training config: precedence (defaults < recipe < --set < flags), --set errors, recipes,
TOML round trip, validation, model overrides and the dry-run estimates."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from pipeline.core.model.flavors import get_flavor
from pipeline.train.assembly.run_config import check_config, resolve_config
from pipeline.train.config.loader import (
    FLAG_TARGETS,
    apply_set,
    list_recipes,
    load_recipe,
    parse_set_value,
    save_config_toml,
)
from pipeline.train.config.schema import SECTIONS, ConfigError, TrainConfig, field_types
from pipeline.train.config.toml_io import dumps, loads
from pipeline.train.report.estimates import dry_run_report, estimate_memory, parameter_counts

RECIPES = [
    "deepseek_v3",
    "glm4_5",
    "glm4_5_air",
    "gpt_oss_120b",
    "gpt_oss_20b",
    "kimi_k2",
    "llama3_2_1b",
    "llama3_2_1b_muon",
    "llama3_2_1b_sft",
    "llama3_70b",
    "llama3_8b",
    "llama3_8b_lora",
    "minimax_m2",
    "mixtral_8x7b",
    "moonlight_16b_a3b",
    "qwen3_30b_a3b",
    "qwen3_5_27b",
    "qwen3_5_35b_a3b",
    "qwen3_8b",
    "qwen3_next_80b_a3b",
    "tiny",
    "tiny_deepseek_v3",
    "tiny_dpo",
    "tiny_glm4_moe",
    "tiny_gpt_oss",
    "tiny_grpo",
    "tiny_grpo_sft",
    "tiny_lora",
    "tiny_minimax_m2",
    "tiny_mistral4",
    "tiny_moe",
    "tiny_muon",
    "tiny_qwen3",
    "tiny_qwen3_5",
    "tiny_qwen3_moe",
    "tiny_seed_oss",
    "tiny_sft",
    "tiny_smollm3",
]
# World sizes the big recipes were written for (the node counts of their sources).
WORLD_SIZES = {
    "llama3_8b": 8,
    "llama3_70b": 32,
    "llama3_2_1b": 8,
    "llama3_2_1b_sft": 8,
    "llama3_2_1b_muon": 8,
    "mixtral_8x7b": 64,
    "qwen3_8b": 8,
    "qwen3_30b_a3b": 16,
    "qwen3_5_27b": 8,
    "qwen3_5_35b_a3b": 16,
    "qwen3_next_80b_a3b": 32,
    "deepseek_v3": 1024,
    "moonlight_16b_a3b": 8,
    "glm4_5_air": 64,
    "glm4_5": 256,
    "minimax_m2": 128,
    "kimi_k2": 1024,
    "gpt_oss_20b": 8,
    "gpt_oss_120b": 32,
}


# ---- precedence ----------------------------------------------------------------------------------


def test_precedence_defaults_recipe_set_flags():
    assert TrainConfig().training.iters == 1000  # default
    assert resolve_config("tiny").training.iters == 300  # recipe over default
    cfg = resolve_config("tiny", sets=["training.iters=500"])
    assert cfg.training.iters == 500  # --set over recipe
    cfg = resolve_config("tiny", sets=["training.iters=500"], flags={"iters": 400})
    assert cfg.training.iters == 400  # flag over --set
    # A flag left at None (not typed by the user) does not override anything.
    cfg = resolve_config("tiny", sets=["training.iters=500"], flags={"iters": None})
    assert cfg.training.iters == 500


def test_later_set_wins_and_layers_touch_only_their_keys():
    cfg = resolve_config(
        "tiny",
        sets=["optimizer.lr=0.01", "optimizer.lr=0.02", "training.seed=7"],
        flags={"global_batch_size": 32},
    )
    assert cfg.optimizer.lr == 0.02
    assert cfg.training.seed == 7
    assert cfg.training.global_batch_size == 32
    assert cfg.training.micro_batch_size == 4  # from the recipe, untouched
    assert cfg.optimizer.min_lr == 1e-4  # from the recipe, untouched


def test_every_flag_targets_a_real_field():
    for flag, dotted in FLAG_TARGETS.items():
        section, key = dotted.split(".")
        assert key in field_types(SECTIONS[section]), flag


def test_flags_set_their_fields():
    flags = {
        "iters": 100,
        "seq_length": 128,
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "lr": 5e-4,
        "device": "cpu",
        "save": "ckpt",
        "load": "old",
        "tp": 2,
        "pp": 2,
        "cp": 1,
        "ep": 1,
        "dp": 1,
    }
    cfg = resolve_config("tiny", flags=flags, world_size=4)
    for flag, value in flags.items():
        section, key = FLAG_TARGETS[flag].split(".")
        assert getattr(getattr(cfg, section), key) == value, flag


def test_data_flag_replaces_mock_data():
    cfg = resolve_config("tiny", flags={"data": "0.7 out/a 0.3 out/b"})
    assert cfg.data.blend == "0.7 out/a 0.3 out/b"
    assert cfg.data.mock is False


def test_unknown_flag_is_an_error():
    with pytest.raises(ConfigError, match="unknown first-class flag 'bogus'"):
        resolve_config("tiny", flags={"bogus": 1})


def test_flag_of_wrong_type_names_the_flag():
    with pytest.raises(ConfigError, match=r"--iters: training.iters expects int, got str"):
        resolve_config("tiny", flags={"iters": "ten"})


# ---- --set parsing and errors --------------------------------------------------------------------


def test_set_unknown_section():
    with pytest.raises(ConfigError) as e:
        apply_set(TrainConfig(), "trainer.iters=5")
    msg = str(e.value)
    assert "--set trainer.iters=5" in msg
    assert "unknown section 'trainer'" in msg
    assert "valid sections: model, data, training, optimizer" in msg


def test_set_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        apply_set(TrainConfig(), "training.itres=5")
    msg = str(e.value)
    assert "unknown key 'itres' in section [training]" in msg
    assert "valid keys: iters, micro_batch_size, global_batch_size, seed" in msg


@pytest.mark.parametrize(
    ("assignment", "expected"),
    [
        ("training.iters=abc", "training.iters expects int, got str 'abc'"),
        ("training.iters=1.5", "training.iters expects int, got float 1.5"),
        ("training.iters=True", "training.iters expects int, got bool True"),
        ("training.compile=1", "training.compile expects bool or None, got int 1"),
        ("optimizer.lr=fast", "optimizer.lr expects float, got str 'fast'"),
        ("optimizer.lr=None", "optimizer.lr expects float, got NoneType None"),
        ("scheduler.decay_iters=[1, 2]", "scheduler.decay_iters expects int or None, got list"),
    ],
)
def test_set_wrong_type(assignment, expected):
    with pytest.raises(ConfigError) as e:
        apply_set(TrainConfig(), assignment)
    assert f"--set {assignment}" in str(e.value)
    assert expected in str(e.value)


def test_set_bad_choice_lists_choices():
    with pytest.raises(
        ConfigError, match="training.dtype must be one of bf16, fp16, fp32; got 'fp64'"
    ):
        apply_set(TrainConfig(), "training.dtype=fp64")


@pytest.mark.parametrize("assignment", ["training.iters", "iters=5", "training.=5", "=5"])
def test_set_malformed(assignment):
    with pytest.raises(ConfigError, match="expected section.key=value"):
        apply_set(TrainConfig(), assignment)


def test_set_value_parsing():
    cfg = TrainConfig()
    apply_set(cfg, "training.compile=true")
    apply_set(cfg, "data.mock=False")
    apply_set(cfg, "optimizer.lr=1")  # int widens to float
    apply_set(cfg, "optimizer.min_lr=1e-5")
    apply_set(cfg, "data.split=98,1,1")  # no quotes needed for strings
    apply_set(cfg, "data.blend=0.7 out/a 0.3 out/b")
    apply_set(cfg, "data.tokenizer='123'")  # quoted: the string 123
    apply_set(cfg, "scheduler.decay_iters=500")
    apply_set(cfg, "checkpoint.load=path/to/ckpt")
    assert cfg.training.compile is True
    assert cfg.data.mock is False
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.min_lr == 1e-5
    assert cfg.data.split == "98,1,1"
    assert cfg.data.blend == "0.7 out/a 0.3 out/b"
    assert cfg.data.tokenizer == "123"
    assert cfg.scheduler.decay_iters == 500
    apply_set(cfg, "scheduler.decay_iters=None")
    apply_set(cfg, "checkpoint.load=none")
    assert cfg.scheduler.decay_iters is None
    assert cfg.checkpoint.load is None


def test_parse_set_value_lists():
    assert parse_set_value("[1, 2]", list[int]) == [1, 2]
    assert parse_set_value("[1, 2]", str) == "[1, 2]"


# ---- recipes -------------------------------------------------------------------------------------


def test_recipes_are_shipped():
    assert list_recipes() == RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_loads_and_validates(name):
    cfg = load_recipe(name)
    if cfg.data.kind == "sft":  # SFT recipes name no data: there is no mock chat data
        cfg.data.blend = "out/chat_messages_document"
    if cfg.data.kind == "dpo":  # nor mock preference pairs
        cfg.data.blend = "out/pairs"
    if cfg.data.kind == "grpo":  # nor mock prompts
        cfg.data.blend, cfg.data.tokenizer = "out/prompts.jsonl", "out/tokenizer"
    check_config(cfg, WORLD_SIZES.get(name))
    flavor = name.removesuffix("_sft").removesuffix("_lora").removesuffix("_dpo")
    assert cfg.model.flavor == flavor.removesuffix("_grpo").removesuffix("_muon")
    assert cfg.lora.enabled == name.endswith("_lora")
    assert cfg.model_config().num_layers > 0


def test_tiny_recipe_is_cpu_sized():
    cfg = load_recipe("tiny")
    t = cfg.training
    assert (cfg.data.seq_length, t.micro_batch_size, t.global_batch_size, t.iters) == (
        256,
        4,
        16,
        300,
    )
    assert (cfg.optimizer.lr, cfg.scheduler.warmup_iters, t.dtype) == (1e-3, 30, "fp32")
    assert cfg.data.mock and parameter_counts(cfg.model_config()).total < 5_000_000


def test_llama3_8b_recipe_follows_megatron_example():
    cfg = load_recipe("llama3_8b")
    p = cfg.parallel
    assert (p.tp, p.pp, p.cp) == (1, 1, 1)
    assert (cfg.data.seq_length, cfg.training.global_batch_size) == (8192, 128)
    assert cfg.training.micro_batch_size == 1
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr) == (1.5e-4, 1e-5)
    assert cfg.scheduler.decay_style == "cosine"
    assert (cfg.optimizer.weight_decay, cfg.optimizer.clip_grad) == (0.1, 1.0)
    assert cfg.training.dtype == "bf16"


def test_unknown_recipe_lists_shipped_ones():
    shipped = "unknown recipe 'llama9'; shipped recipes: deepseek_v3, .*, llama3_2_1b, "
    with pytest.raises(ConfigError, match=shipped):
        load_recipe("llama9")


def test_recipe_file_errors_name_the_file(tmp_path):
    bad_key = tmp_path / "bad.toml"
    bad_key.write_text("[training]\nitres = 3\n")
    with pytest.raises(ConfigError, match=rf"{bad_key}: unknown key 'itres'"):
        load_recipe(bad_key)
    bad_type = tmp_path / "type.toml"
    bad_type.write_text('[optimizer]\nlr = "high"\n')
    with pytest.raises(ConfigError, match=rf"{bad_type}: optimizer.lr expects float"):
        load_recipe(bad_type)
    not_table = tmp_path / "flat.toml"
    not_table.write_text("iters = 3\n")
    with pytest.raises(ConfigError, match="must be a table"):
        load_recipe(not_table)
    broken = tmp_path / "broken.toml"
    broken.write_text("[training\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_recipe(broken)
    with pytest.raises(ConfigError, match="not found"):
        load_recipe(tmp_path / "missing.toml")


# ---- TOML output ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RECIPES)
def test_to_toml_round_trips(name, tmp_path):
    cfg = resolve_config(name, sets=["data.tokenizer=tok/dir"], validate=False)
    assert loads(cfg.to_toml()) == cfg.to_dict()
    path = tmp_path / "run" / "config.toml"
    save_config_toml(cfg, path)
    assert load_recipe(path) == cfg
    assert [p.name for p in path.parent.iterdir()] == ["config.toml"]  # no temporary left


def test_to_dict_drops_unset_values():
    d = TrainConfig().to_dict()
    assert "decay_iters" not in d["scheduler"]
    assert "recipe" not in d["fp8"]
    assert d["training"]["seed"] == 1234


def test_optional_fields_default_to_none():
    """The invariant that makes dropping None from TOML lossless."""
    for name, cls in SECTIONS.items():
        defaults = cls()
        for f in dataclasses.fields(cls):
            tp = field_types(cls)[f.name]
            if type(None) in typing.get_args(tp):
                assert getattr(defaults, f.name) is None, f"{name}.{f.name}"


def test_toml_writer_escapes_strings():
    tricky = 'a "quoted" \\ back\tslash\nnew line \x01 \x7f ünï 🙂'
    text = dumps({"s": {"v": tricky, "f": 1e-5, "i": -3, "b": False, "l": [1, 2.5, "x"]}})
    assert loads(text) == {"s": {"v": tricky, "f": 1e-5, "i": -3, "b": False, "l": [1, 2.5, "x"]}}
    with pytest.raises(TypeError, match="s.v: cannot write dict"):
        dumps({"s": {"v": {}}})


# ---- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "world_size", "expected"),
    [
        (["training.global_batch_size=10"], None, "divisible by micro_batch_size \\* dp"),
        (["parallel.dp=8"], None, r"global_batch_size \(16\) must be divisible.*\(4 \* 8\)"),
        ([], 3, None),  # dp inferred 3: 16 % 12 -> error below
        (["parallel.tp=3"], 4, "world size 4 is not divisible by tp\\*pp\\*cp = 3"),
        (["parallel.dp=2"], 4, "does not match world size 4"),
        (["scheduler.warmup_iters=300"], None, "warmup_iters \\(300\\) < decay iters \\(300\\)"),
        (["scheduler.decay_style=wsd"], None, "needs scheduler.wsd_decay_iters"),
        (
            ["scheduler.decay_style=wsd", "scheduler.wsd_decay_iters=290"],
            None,
            "wsd_decay_iters \\(290\\) must be in \\(0, decay iters - warmup_iters = 270\\]",
        ),
        (["optimizer.min_lr=0.1"], None, "min_lr \\(0.1\\) <= optimizer.lr"),
        (["data.blend=out/a"], None, "data.mock is set together with a data blend"),
        (["data.mock=false"], None, "no training data"),
        (["data.blend=out/a", "data.train_blend=out/b", "data.mock=false"], None, "excludes"),
        (["data.split=9,x"], None, "data.split '9,x'"),
        (["parallel.tp=3"], None, "tp \\(3\\) must divide num_attention_heads \\(4\\)"),
        (["parallel.ep=2"], None, "needs a MoE model; tiny is dense"),
        (["parallel.pp=8"], None, "exceeds the model's 4 layers"),
        (["parallel.cp=3"], None, "divisible by 2 \\* cp"),
        (["model.flavor=huge"], None, "unknown model.flavor 'huge'; known flavors: llama3_8b"),
        (["training.iters=0"], None, "training.iters must be positive"),
    ],
)
def test_validation_errors(sets, world_size, expected):
    cfg = resolve_config("tiny", sets=sets, validate=False)
    with pytest.raises(ConfigError, match=expected or "global_batch_size"):
        check_config(cfg, world_size)


def test_validation_reports_every_problem_at_once():
    cfg = resolve_config(
        "tiny", sets=["training.global_batch_size=10", "optimizer.min_lr=1.0"], validate=False
    )
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert "min_lr" in str(e.value) and "global_batch_size" in str(e.value)


def test_dp_inference():
    cfg = resolve_config("tiny", flags={"tp": 2}, world_size=4)
    assert cfg.data_parallel_size(4) == 2
    assert cfg.data_parallel_size() == 1


def test_ep_on_moe_validates():
    resolve_config("tiny_moe", flags={"ep": 2}, world_size=2)
    with pytest.raises(ConfigError, match="ep \\(3\\) must divide num_experts \\(4\\)"):
        resolve_config("tiny_moe", flags={"ep": 3})


# ---- model overrides -----------------------------------------------------------------------------


def test_model_overrides_apply_to_the_flavor():
    cfg = resolve_config("tiny", sets=["model.num_layers=2", "model.rope_theta=10000"])
    m = cfg.model_config()
    assert (m.num_layers, m.rope_theta, m.hidden_size) == (2, 10000.0, 128)


def test_reshaping_rederives_head_dim_and_kv_heads():
    m = resolve_config("tiny", sets=["model.hidden_size=256"]).model_config()
    assert m.head_dim == 64  # 256 / 4 heads, not the flavor's 32
    base = get_flavor("tiny")
    assert base.num_kv_heads != base.num_attention_heads  # GQA flavor keeps its kv heads
    m = resolve_config("tiny", sets=["model.num_attention_heads=8"]).model_config()
    assert (m.head_dim, m.num_kv_heads) == (16, 2)


def test_moe_overrides():
    m = resolve_config("tiny_moe", sets=["model.num_experts=0"]).model_config()
    assert m.moe is None
    m = resolve_config("tiny", sets=["model.num_experts=8", "model.moe_top_k=1"]).model_config()
    assert (m.moe.num_experts, m.moe.top_k) == (8, 1)
    with pytest.raises(ConfigError, match="moe_top_k need a MoE model"):
        resolve_config("tiny", sets=["model.moe_top_k=1"]).model_config()
    with pytest.raises(ConfigError, match="invalid model"):
        resolve_config("tiny", sets=["model.num_attention_heads=3"]).model_config()


# ---- dry-run estimates ---------------------------------------------------------------------------


def test_llama3_8b_parameter_count():
    """Meta's Llama 3 8B has 8.03 B parameters (8,030,261,248 in the released safetensors)."""
    counts = parameter_counts(get_flavor("llama3_8b"))
    assert abs(counts.total - 8.03e9) / 8.03e9 < 0.001
    assert counts.total == 8_030_261_248
    assert counts.active == counts.total and counts.expert == 0


def test_mixtral_active_parameters():
    """Mistral's figures for Mixtral 8x7B: 46.7 B total, 12.9 B active per token."""
    counts = parameter_counts(get_flavor("mixtral_8x7b"))
    assert abs(counts.total - 46.7e9) / 46.7e9 < 0.005
    assert abs(counts.active - 12.9e9) / 12.9e9 < 0.005


def test_llama3_8b_memory_estimate():
    cfg = load_recipe("llama3_8b")
    mem = estimate_memory(cfg, cfg.model_config(), world_size=8)
    # 16 bytes per parameter, sharded over dp = 8 (tp = pp = cp = 1).
    assert mem.state == pytest.approx(16 * 8_030_261_248 / 8)
    assert mem.activations_full < mem.activations_none
    # bf16, seq 8192: per layer per token 4h + 2q + 2kv + 3f elements, plus fp32-loss logits.
    per_layer = (4 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336) * 8192 * 2
    logits = 8192 * 128256 * (2 + 4)
    assert mem.activations_none == pytest.approx(32 * per_layer + logits)


def test_experts_are_whole_on_each_tp_rank_in_the_memory_estimate():
    """ep beside tp: experts split over ep (and pp) only, then sharded over dp / ep; the
    other parameters over tp, then over dp."""
    cfg = load_recipe("qwen3_30b_a3b")
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep = 2, 1, 4
    counts = parameter_counts(cfg.model_config())
    mem = estimate_memory(cfg, cfg.model_config(), world_size=16)  # dp 8, edp 2
    dense = counts.total - counts.expert
    assert mem.state == pytest.approx(16 * (dense / 2 / 8 + counts.expert / 4 / 2))


def test_dry_run_report_llama3_8b():
    lines = dry_run_report(load_recipe("llama3_8b"), world_size=8)
    text = "\n".join(lines)
    assert "8,030,261,248 total (8.03 B)" in text
    assert "dp 8 (inferred) = 8 devices" in text
    assert "micro 1 x accumulation 16 x dp 8 = global 128" in text
    assert "GFLOP/token" in text and "GiB" in text


def test_dry_run_report_moe_shows_active_parameters():
    text = "\n".join(dry_run_report(load_recipe("tiny_moe")))
    assert "active per token" in text
    assert "assuming 1" in text


def test_choice_fields_are_literals_checked_by_the_setter():
    """A field with fixed values is a `Literal`; FP8's linear filters are the backend's own."""
    from pipeline.core.kernels.fp8 import LINEAR_FILTERS
    from pipeline.train.config.fields import literal_values
    from pipeline.train.config.schema import Fp8Section, TrainingSection

    assert literal_values(field_types(Fp8Section)["linear_filter"]) == LINEAR_FILTERS
    assert literal_values(field_types(TrainingSection)["device"]) == ("auto", "cpu", "cuda")
    cfg = TrainConfig()
    apply_set(cfg, "training.activation_checkpointing=none")  # not Python's None
    assert cfg.training.activation_checkpointing == "none"
    with pytest.raises(ConfigError, match="training.device expects str, got int 5"):
        cfg.set("training.device", 5)
    with pytest.raises(ConfigError, match="training.device must be one of auto, cpu, cuda"):
        apply_set(cfg, "training.device=5")


def test_the_config_module_neither_reads_files_nor_imports_the_checkpoint_reader():
    import subprocess
    import sys

    code = (
        "import sys, pipeline.train.config.schema as c\n"
        "cfg = c.TrainConfig()\n"
        "cfg.data.mock = True\n"
        "cfg.validate(1).model_config()\n"
        "assert not [m for m in sys.modules if m.startswith('pipeline.checkpoint')], sys.modules\n"
        "assert 'pipeline.train.state.checkpoint_model' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
