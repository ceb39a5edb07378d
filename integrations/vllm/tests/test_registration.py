"""Registration: entry points, idempotence, pickling by name in a fresh process, the CPU
platform's selection, engine-argument parsing (Python API), start-up errors, and the CLI
launcher running ``vllm bench latency --attention-backend mla_absorb`` (a real engine)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mla_backend_integrations.vllm import plugin

BACKEND_PATH = "mla_backend_integrations.vllm.backend.MLAAbsorbBackend"


def test_entry_points_are_installed() -> None:
    general = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    platform = {e.name: e.value for e in entry_points(group="vllm.platform_plugins")}
    assert general.get("mla_absorb") == "mla_backend_integrations.vllm.plugin:register"
    assert platform.get("mla_absorb") == "mla_backend_integrations.vllm.plugin:platform_hook"
    assert entry_points(group="vllm.platform_plugins")["mla_absorb"].load()() is None


def test_registration_is_idempotent() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    plugin.register()
    a = plugin.register_backend_enum()
    plugin.register()
    plugin.platform_hook()
    b = plugin.register_backend_enum()
    assert a is b is AttentionBackendEnum["MLA_ABSORB"]
    assert a.get_path() == BACKEND_PATH
    assert a.get_class().get_name() == "MLA_ABSORB"


def test_member_unpickles_in_a_fresh_process_without_plugins() -> None:
    blob = pickle.dumps(plugin.register_backend_enum())
    code = (
        "import pickle, sys\n"
        "m = pickle.loads(sys.stdin.buffer.read())\n"
        "print(m.name, m.get_path())\n"
    )
    env = dict(os.environ, VLLM_PLUGINS="none")  # no plugin of any group may run
    res = subprocess.run(
        [sys.executable, "-c", code], input=blob, capture_output=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert res.stdout.decode().split() == ["MLA_ABSORB", BACKEND_PATH]


def _selector(head_size: int, **kw) -> object:
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(
        head_size=head_size,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=128,
        use_mla=True,
        **kw,
    )


def test_cpu_platform_selects_mla_absorb_and_keeps_default_otherwise() -> None:
    from vllm.platforms.cpu import CpuPlatform

    plugin.register()
    member = plugin.register_backend_enum()
    assert CpuPlatform.get_attn_backend_cls(member, _selector(128)) == BACKEND_PATH
    default = CpuPlatform.get_attn_backend_cls(None, _selector(576))
    assert default.endswith(("AMXMLABackend", "CPUMLABackend"))
    # a sparse MLA layer (DeepSeek-V3.2 / GLM-5): our sparse backend, where vLLM's CPU platform
    # raises "Sparse Attention is not supported on CPU."
    sparse = CpuPlatform.get_attn_backend_cls(member, _selector(576, use_sparse=True))
    assert sparse == plugin.SPARSE_BACKEND_PATH
    with pytest.raises(NotImplementedError, match="Sparse Attention"):
        CpuPlatform.get_attn_backend_cls(None, _selector(576, use_sparse=True))


def test_python_api_engine_config(tmp_path: Path, model_dirs) -> None:
    """``attention_backend="mla_absorb"`` parses, selects our backend, keeps chunked prefill
    and prefix caching (vLLM CPU turns them off for its reference MLA backend) and forces
    native RoPE."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model_dirs["odd"]),
        attention_backend="mla_absorb",
        max_model_len=512,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,
        block_size=16,
        skip_tokenizer_init=True,
    )
    cfg = args.create_engine_config()
    assert cfg.attention_config.backend.name == "MLA_ABSORB"
    assert cfg.scheduler_config.enable_chunked_prefill
    assert cfg.cache_config.enable_prefix_caching
    assert cfg.cache_config.block_size == 16
    assert "-rotary_embedding" in cfg.compilation_config.custom_ops


def test_unsupported_kv_cache_dtype_fails_at_startup(model_dirs) -> None:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model_dirs["odd"]),
        attention_backend="mla_absorb",
        max_model_len=512,
        kv_cache_dtype="fp8_e5m2",
        skip_tokenizer_init=True,
    )
    with pytest.raises(Exception, match="fp8_e5m2"):
        args.create_engine_config()


def test_untested_vllm_version_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugin.ALLOW_UNTESTED_ENV, raising=False)
    plugin.check_vllm_version("0.32.0")
    plugin.check_vllm_version("0.32.1+cpu")
    for bad in ("0.31.2", "0.33.0", "1.0.0", "garbage"):
        with pytest.raises(RuntimeError, match=bad.replace(".", r"\.")):
            plugin.check_vllm_version(bad)
    monkeypatch.setenv(plugin.ALLOW_UNTESTED_ENV, "1")
    plugin.check_vllm_version("0.40.0")  # warning only


#: a DSA model's config fields (DeepSeek-V3.2's indexer dims), for the start-up checks
DSA_HF = dict(index_topk=2048, index_n_heads=64, index_head_dim=128, qk_rope_head_dim=64,
              q_lora_rank=1536)  # fmt: skip


def _fake_config(**model_kw) -> SimpleNamespace:
    hf = SimpleNamespace(**model_kw.pop("hf", {}))
    model = SimpleNamespace(
        use_mla=model_kw.get("use_mla", True),
        model="m",
        architectures=["X"],
        get_sliding_window=lambda: model_kw.get("window"),
        hf_text_config=hf,
        max_model_len=model_kw.get("max_model_len", 1024),
        dtype=model_kw.get("dtype"),
    )
    return SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(
            cache_dtype=model_kw.get("cache_dtype", "auto"),
            block_size=model_kw.get("block_size", 16),
        ),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=model_kw.get("dcp", 1),
            prefill_context_parallel_size=model_kw.get("pcp", 1),
            cp_kv_cache_interleave_size=model_kw.get("interleave", 1),
            dcp_q_replicate=model_kw.get("q_replicate"),
            tensor_parallel_size=model_kw.get("tp", 1),
        ),
        attention_config=SimpleNamespace(indexer_kv_dtype=model_kw.get("indexer_kv", "auto")),
    )


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        (dict(window=4096), "sliding_window=4096"),
        (dict(hf={"use_alibi": True}), "use_alibi"),
        (dict(use_mla=False), "does not use MLA"),
        (dict(hf={**DSA_HF, "index_topk": 0}), "topk=0"),
        (dict(hf={**DSA_HF, "index_head_dim": 64}), "index_head_dim 64"),
        (dict(hf={**DSA_HF, "index_head_dim": 96}), "index_head_dim 96"),
        (dict(hf={**DSA_HF, "index_n_heads": 0}), "n_heads=0"),
        (dict(hf={**DSA_HF, "q_lora_rank": None}), "q_lora_rank=None"),
        (dict(hf=DSA_HF, indexer_kv="mxfp4"), "indexer_kv_dtype='mxfp4'"),
        (dict(cache_dtype="int8"), "kv_cache_dtype='int8'"),
        (dict(pcp=2), "prefill_context_parallel_size=2"),
        (dict(dcp=2, q_replicate=True), "dcp_q_replicate=True"),
        (dict(dcp=2, interleave=3), "cp_kv_cache_interleave_size=3 does not divide block_size=16"),
        (dict(dcp=2, interleave=32), "cp_kv_cache_interleave_size=32 does not divide"),
    ],
)
def test_unsupported_settings_are_named(kw: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[")):
        plugin.validate_engine_config(_fake_config(**kw))
    plugin.validate_engine_config(_fake_config())  # the supported cases pass
    plugin.validate_engine_config(_fake_config(hf=DSA_HF))
    plugin.validate_engine_config(_fake_config(hf={**DSA_HF, "index_head_dim": 256}))


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache_dtype", ["auto", "bfloat16", "float16", "fp8", "fp8_ds_mla"])
def test_plain_cache_of_another_dtype_is_refused_at_startup(model_dtype, cache_dtype) -> None:
    """A plain cache is read in the model's dtype (the attention ops refuse a plain cache of
    another dtype at the first forward): a named plain dtype other than the model's is refused
    at start-up naming both, while 'auto' and the fp8 layouts serve every model dtype."""
    hf = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
    cfg = _fake_config(hf=hf, dtype=model_dtype, cache_dtype=cache_dtype)
    named = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cache_dtype)
    if named is not None and named != model_dtype:
        with pytest.raises(ValueError, match=f"kv_cache_dtype='{cache_dtype}' with "
                                             f"dtype={model_dtype}"):  # fmt: skip
            plugin.validate_engine_config(cfg)
    else:
        plugin.validate_engine_config(cfg)


#: a DeepSeek-V4 model's config fields (its attention dims, the tiny checkpoint's schedule)
V4_HF = dict(model_type="deepseek_v4", head_dim=512, qk_rope_head_dim=64, index_topk=512,
             compress_ratios=[128, 4, 0, 4], sliding_window=128)  # fmt: skip


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        (dict(hf={**V4_HF, "head_dim": 256}), "head_dim=256"),
        (dict(hf={**V4_HF, "qk_rope_head_dim": 32}), "qk_rope_head_dim=32"),
        (dict(hf=V4_HF, cache_dtype="bfloat16"), "kv_cache_dtype='bfloat16'"),
        (dict(hf=V4_HF, tp=2), "tensor_parallel_size=2"),
        (dict(hf=V4_HF, indexer_kv="mxfp4"), "indexer_kv_dtype='mxfp4'"),
        (dict(hf=V4_HF, dcp=2), "decode_context_parallel_size=2"),
        (dict(hf={**V4_HF, "index_topk": 256}, max_model_len=4096),
         r"index_topk=256 .* max_model_len=4096 .* supported: index_topk 512, or max_model_len <= "
         r"1024"),
    ],
)
def test_v4_unsupported_settings_are_named(kw: dict, named: str) -> None:
    """DeepSeek-V4 (its sliding window is not refused: V4 runs its own model path); what the
    V4 ops do not serve yet is refused at start-up, naming the value."""
    with pytest.raises(ValueError, match=named):
        plugin.validate_engine_config(_fake_config(**kw))
    plugin.validate_engine_config(_fake_config(hf=V4_HF, window=128, max_model_len=2048))
    plugin.validate_engine_config(_fake_config(hf=V4_HF, window=128, max_model_len=131072))
    plugin.validate_engine_config(_fake_config(hf={**V4_HF, "index_topk": 256}, window=128,
                                               max_model_len=1024))  # fmt: skip
    plugin.validate_engine_config(_fake_config(hf={**V4_HF, "compress_ratios": [128, 0]},
                                               max_model_len=65536))  # fmt: skip


@pytest.mark.parametrize("kw", [dict(dcp=2), dict(dcp=4, interleave=16), dict(dcp=2, interleave=8)])
def test_decode_context_parallel_settings_pass(kw: dict) -> None:
    plugin.validate_engine_config(_fake_config(**kw))


def test_cli_launcher_bench_latency(model_dirs) -> None:
    """``vllm bench latency`` through the launcher; the engine's worker processes (spawned)
    resolve MLA_ABSORB and log its selection."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [
        sys.executable,
        "-m",
        "mla_backend_integrations.vllm.cli",
        "bench",
        "latency",
        "--model",
        str(model_dirs["odd"]),
        "--attention-backend",
        "mla_absorb",
        "--input-len",
        "48",
        "--output-len",
        "8",
        "--batch-size",
        "2",
        "--num-iters-warmup",
        "1",
        "--num-iters",
        "1",
        "--skip-tokenizer-init",
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--dtype",
        "float32",
    ]
    res = subprocess.run(cmd, capture_output=True, env=env, timeout=900, text=True)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert "Avg latency" in log
    assert "Using MLA_ABSORB backend" in log
    assert "'attention_backend': 'mla_absorb'" in log


def test_workarounds_are_version_guarded(caplog: pytest.LogCaptureFixture) -> None:
    """Every compat workaround applies inside its vLLM range only; a skip is logged once."""
    from mla_backend_integrations import _common
    from mla_backend_integrations.vllm import compat

    for w in compat.WORKAROUNDS:
        assert w.upstream and w.applies("0.32.0") and w.applies("0.32.1+cpu")
        assert w.applies()  # the installed vllm-cpu 0.32
        _common._SKIPPED.discard(w.name)
        with caplog.at_level("WARNING", logger="vllm.mla_absorb"):
            assert not w.applies("0.33.0")
            assert not w.applies("0.31.9")
        skipped = [r for r in caplog.records if repr(w.name) in r.getMessage()]
        assert len(skipped) == 1 and "0.33.0" in skipped[0].getMessage()
        caplog.clear()


def test_native_rope_skipped_outside_its_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_backend_integrations.vllm import compat

    monkeypatch.setattr(
        compat,
        "NATIVE_ROPE_ON_CPU",
        compat.NATIVE_ROPE_ON_CPU.__class__(
            **{**compat.NATIVE_ROPE_ON_CPU.__dict__, "version_of": lambda: "0.40.0"}
        ),
    )
    cfg = SimpleNamespace(compilation_config=SimpleNamespace(custom_ops=["+rotary_embedding"]))
    compat.force_native_rope(cfg)
    assert cfg.compilation_config.custom_ops == ["+rotary_embedding"]
