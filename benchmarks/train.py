"""The training benchmark: training tokens per second and MFU, kvjax against PyTorch.

kvjax runs `kvjax.train.update.train_step` (AdamW, global-norm clipping, one compiled step) on
a decoder-only LM of a preset's sizes, or of a published model's shape (`SHAPES`), with random
tokens, on one device and, with `devices > 1`, with each batch split over that many devices
(`data` of a mesh; on a CPU, host devices). PyTorch runs Hugging Face's model of the same
sizes (GPT-2, or Llama for the Llama shape) with the same batch, sequence length, AdamW and
clipping, eager and optionally through `torch.compile` (optional: `pip install -e
".[bench]"`). In bfloat16 kvjax computes in it over float32 params and PyTorch runs under
autocast, the usual mixed precision of each. Every contender is warmed up, then timed over
`steps` steps; the best of `repeats` timings counts, for every contender alike. Tokens per
second count every input token of the batch.

MFU (model FLOPs utilisation) is the model's FLOPs per step over the step's time and over the
matrix-multiply peak measured on this device in the same dtype: a square product of
`PEAK_SIZE` (more on an accelerator), the best of a few. The model's FLOPs per token are
nanoGPT's and PaLM's count, 6 per weight that multiplies (every parameter but the position
table, and the input table when the output layer has its own) plus 12 · layers · heads ·
head_dim · sequence length for attention; the same count for every contender.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M
from kvjax import parallel
from kvjax.model.fused_attention import fused_attention_applies

from .decode import _machine
from .floors import best_seconds

LAYER_MODES = ("scanned", "unrolled")


# Published models' shapes (not their weights), trained from random initial weights.
SHAPES: dict[str, M.TransformerConfig] = {
    "gpt2-small": M.TransformerConfig(  # GPT-2 small, 124M parameters
        vocab_size=50257, d_model=768, num_heads=12, d_ff=3072, num_decoder_layers=12,
        max_len=1024, positional_encoding="learned", norm="pre", activation="gelu",
        layer_norm_eps=1e-5, qkv_bias=True, out_bias=True, scale_embeddings=False),
    "llama-1b": M.TransformerConfig(  # Llama-3.2-1B
        vocab_size=128256, d_model=2048, num_heads=32, num_kv_heads=8, head_dim=64, d_ff=8192,
        num_decoder_layers=16, max_len=2048, positional_encoding="rope", rope_base=500000.0,
        rope_scaling="llama3", rope_scaling_factor=32.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_len=8192, norm="pre",
        norm_type="rmsnorm", layer_norm_eps=1e-5, activation="swiglu", ffn_bias=False,
        scale_embeddings=False),
}
PEAK_SIZE = 1024  # the side of the square product the matmul peak is measured with (a CPU)
ACCELERATOR_PEAK_SIZE = 8192


@dataclasses.dataclass(frozen=True)
class TrainRow:
    """One contender: seconds per training step at the benchmark's batch and length, and the
    model FLOPs of a step (`model_flops_per_token` times its tokens)."""

    name: str
    step_seconds: float
    tokens_per_step: int
    flops_per_step: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds

    def mfu(self, peak_flops: float) -> float:
        return self.flops_per_step / self.step_seconds / peak_flops


def model_config(name: str) -> M.TransformerConfig:
    """A preset (`model.PRESETS`) or a published model's shape (`SHAPES`)."""
    return SHAPES[name] if name in SHAPES else M.preset(name)


def model_flops_per_token(config: M.TransformerConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward): 6 per multiplying weight, plus
    12 · layers · heads · head_dim · seq_len for attention's two products (see above)."""
    shapes = M.param_shapes(config)
    weights = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        names = [str(getattr(key, "key", key)) for key in path]
        looked_up = names[-1] == "position_embedding" or (
            names[-1] == "embedding" and not config.tie_embeddings)
        weights += 0 if looked_up else leaf.size
    attention = 12 * config.num_decoder_layers * config.num_heads * config.head_dim * seq_len
    return 6.0 * weights + attention


def measure_matmul_peak(dtype: str = "float32", repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` square matrix products in `dtype` (float32
    accumulation), of side PEAK_SIZE on a CPU and ACCELERATOR_PEAK_SIZE elsewhere."""
    size = PEAK_SIZE if jax.default_backend() == "cpu" else ACCELERATOR_PEAK_SIZE
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    b = jax.random.normal(jax.random.key(1), (size, size), dtype)
    product = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    jax.block_until_ready(product(a, b))
    return 2.0 * size**3 / best_seconds(lambda: product(a, b), repeats)


def _best_step_seconds(step: Callable[[], object], steps: int, repeats: int) -> float:
    jax.block_until_ready(step())  # compiles (kvjax) or warms up (PyTorch)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            out = step()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / steps)
    return best


@dataclasses.dataclass(frozen=True)
class KvjaxStep:
    """One compiled training step of kvjax, ready to run on its own state and batch."""

    run: Callable[[], jax.Array]  # one step; returns its loss
    peak_bytes: int  # what the compiled step holds at once (`peak_bytes`)
    trained_params: int  # params with gradients: every param, or LoRA's adapters


def peak_bytes(compiled) -> int:
    """What a compiled program holds at once: arguments and outputs (less the outputs
    written over donated arguments) and temporaries."""
    stats = compiled.memory_analysis()
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
               - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def kvjax_step(config: M.TransformerConfig, batch_np: dict, mesh=None,
               deterministic: bool = False, lora: M.LoRA | None = None,
               remat: bool = False) -> KvjaxStep:
    """`kvjax.train.update`'s step on fresh params (LoRA's adapters on them as a frozen base
    with `lora`), compiled once ahead of time: the program timed is the one measured."""
    from kvjax.train import lora as train_lora
    from kvjax.train import update
    from kvjax.train.config import TrainConfig

    train_config = TrainConfig(steps=10_000, batch_size=len(batch_np["inputs"]), warmup_steps=10,
                               progress=False, deterministic=deterministic, lora=lora,
                               remat=remat)
    step_config = update.compiled_fields(train_config)
    params = base = None
    if lora is not None:
        base = train_lora.as_base(M.init_params(config, jax.random.key(0)), lora)
        params = train_lora.init_adapters(config, train_config, base)
    state = update.init_state(config, train_config, mesh, params=params)
    batch = batch_np if mesh is None else parallel.shard_batch(batch_np, mesh)
    compiled = update._compiled_step(deterministic, jax.default_backend()).lower(
        config, step_config, state, batch, base, mesh=mesh).compile()
    trained = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    holder = {"state": state}

    def run():
        holder["state"], loss = compiled(holder["state"], batch, base)
        return loss

    return KvjaxStep(run, peak_bytes(compiled), trained)


def _torch_model(config: M.TransformerConfig, shape: str | None):
    """Hugging Face's model of `config`'s sizes: Llama for the Llama shape, else GPT-2."""
    import transformers

    if shape == "llama-1b":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=config.d_model,
            intermediate_size=config.d_ff, num_hidden_layers=config.num_decoder_layers,
            num_attention_heads=config.num_heads, num_key_value_heads=config.kv_heads,
            head_dim=config.head_dim, max_position_embeddings=config.max_len,
            rms_norm_eps=config.layer_norm_eps, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=0, pad_token_id=0))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.max_len, n_embd=config.d_model,
        n_layer=config.num_decoder_layers, n_head=config.num_heads, n_inner=config.d_ff,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        pad_token_id=0))


def _torch_steps(config: M.TransformerConfig, batch_np: dict, shape: str | None,
                 dtype: str, compiled: bool) -> tuple[dict[str, Callable], str]:
    """{name: step} for PyTorch eager and, if `compiled`, `torch.compile`, and a note."""
    try:
        import torch
        import transformers
    except ImportError:
        return {}, "not installed (pip install -e '.[bench]')"
    from .decode import torch_on_gpu

    device = torch.device("cuda" if torch_on_gpu() else "cpu")
    inputs = torch.as_tensor(batch_np["inputs"], dtype=torch.long, device=device)
    labels = torch.as_tensor(batch_np["targets"], dtype=torch.long, device=device)
    autocast = dtype != "float32"

    def make_step(compile_model: bool) -> Callable:
        torch.manual_seed(0)
        model = _torch_model(config, shape).to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98),
                                      weight_decay=0.01)
        forward = torch.compile(model) if compile_model else model

        def step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, getattr(torch, dtype), enabled=autocast):
                logits = forward(inputs).logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                         labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return None

        return step

    kind = "Llama" if shape == "llama-1b" else "GPT-2"
    steps = {f"PyTorch eager (HF {kind})": make_step(False)}
    if compiled:
        steps[f"PyTorch torch.compile (HF {kind})"] = make_step(True)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{torch.get_num_threads()} threads")
    precision = f"autocast to {dtype}" if autocast else "float32"
    note = (f"transformers {transformers.__version__}, torch {torch.__version__}, {where}, "
            f"{precision}")
    return steps, note


def train_benchmark(preset: str = "gpt-mini", batch_size: int = 8, seq_len: int = 256,
                    steps: int = 5, repeats: int = 3, *, devices: int = 1,
                    layer_modes: tuple[str, ...] = LAYER_MODES, compare_torch: bool = True,
                    deterministic: tuple[bool, ...] = (False,), dtype: str = "float32",
                    torch_compile: bool = False, log: Callable[[str], None] = print
                    ) -> tuple[list[TrainRow], str, float]:
    """Times every contender; returns the rows, a line naming the setting and machine, and
    the measured matmul peak (FLOP/s in `dtype`). `preset` names a preset or a shape of
    `SHAPES`. kvjax runs once for each setting of `TrainConfig.deterministic` in
    `deterministic`; `torch_compile` adds PyTorch through `torch.compile`."""
    config = model_config(preset).replace(dtype=dtype)
    if seq_len > config.max_len:
        raise ValueError(f"seq_len {seq_len} exceeds the {preset} max_len {config.max_len}")
    if devices > jax.device_count():
        raise ValueError(f"devices={devices} but JAX sees {jax.device_count()}; on a CPU, "
                         f"start with XLA_FLAGS=--xla_force_host_platform_device_count="
                         f"{devices}")
    if batch_size % devices:
        raise ValueError(f"batch size {batch_size} is not divisible by devices={devices}")
    unknown = sorted(set(layer_modes) - set(LAYER_MODES))
    if unknown or not layer_modes:
        raise ValueError(f"layer modes {unknown or list(layer_modes)} not in {LAYER_MODES}")
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, (batch_size, seq_len + 1))
    batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
    meshes = {1: None}
    if devices > 1:
        meshes[devices] = parallel.make_mesh(f"data={devices}", jax.devices()[:devices])
    flops = model_flops_per_token(config, seq_len) * batch_size * seq_len
    rows = []
    for mode in layer_modes:
        mode_config = config.replace(scan_layers=mode == "scanned")
        for (count, mesh), exact in itertools.product(meshes.items(), deterministic):
            name = (f"kvjax, {mode} layers, {count} device{'s' if count > 1 else ''}"
                    f"{', deterministic' if exact else ''}")
            log(f"{name} ...")
            seconds = _best_step_seconds(kvjax_step(mode_config, batch, mesh, exact).run, steps,
                                         repeats)
            rows.append(TrainRow(name, seconds, batch_size * seq_len, flops))
    shape = preset if preset in SHAPES else None
    torch_steps, note = (_torch_steps(config, batch, shape, dtype, torch_compile)
                         if compare_torch else ({}, "skipped"))
    for name, step in torch_steps.items():
        log(f"{name} ...")
        rows.append(TrainRow(name, _best_step_seconds(step, steps, repeats),
                             batch_size * seq_len, flops))
    log("matmul peak ...")
    peak = measure_matmul_peak(dtype)
    setting = (f"Training, `{preset}` sizes in {dtype}, batch {batch_size} x {seq_len} tokens, "
               f"AdamW with clipping; best of {repeats} x {steps} steps; kvjax's attention "
               f"through {_attention_route(config)}. Machine: {_machine()}. PyTorch: {note}.")
    return rows, setting, peak


def _attention_route(config: M.TransformerConfig) -> str:
    probe = jnp.zeros((1, 1, config.num_heads, config.head_dim), config.compute_dtype)
    # A scanned stack of local and global layers traces each layer's kind, and describes
    # no mask to the kernel; sinks join a softmax the kernel does not compute.
    kinds_traced = (config.sliding_window is not None and config.scan_layers
                    and bool(config.full_attention_layers))
    fused = not (kinds_traced or config.attention_sinks) and fused_attention_applies(
        probe, probe, probe, config.attention_softcap)
    return "cuDNN's fused kernel (XLA's ops with deterministic ops)" if fused else "XLA's ops"


def _percent(fraction: float) -> str:
    """One decimal, or two significant digits where that would round a tiny model's MFU to 0."""
    return f"{fraction:.1%}" if fraction >= 0.01 else f"{fraction * 100:.2g}%"


def format_train_table(rows: list[TrainRow], setting: str, peak_flops: float) -> str:
    """A Markdown table: tokens/s, step time and MFU per contender, and the ratio to PyTorch
    eager."""
    torch_rows = [r for r in rows if r.name.startswith("PyTorch")]
    reference = torch_rows[0].tokens_per_second if torch_rows else None
    lines = [setting, "", "| contender | tokens/s | step ms | MFU | vs PyTorch eager |",
             "|:---|---:|---:|---:|---:|"]
    for r in rows:
        ratio = "-" if reference is None else f"{r.tokens_per_second / reference:.2f}x"
        lines.append(f"| {r.name} | {r.tokens_per_second:,.0f} | {r.step_seconds * 1e3:.1f} "
                     f"| {_percent(r.mfu(peak_flops))} | {ratio} |")
    flops = rows[0].flops_per_step / rows[0].tokens_per_step if rows else 0.0
    lines += ["", f"MFU: {flops / 1e9:.3g} GFLOPs of the model per token over the matmul "
                  f"peak measured here, {peak_flops / 1e12:.2f} TFLOP/s."]
    return "\n".join(lines)
