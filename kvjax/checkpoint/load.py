"""Loading a checkpoint for sampling: config, tokenizer and params, all checked."""

from __future__ import annotations

import os
from typing import Any

from .layout import CONFIG_FILE, TOKENIZER_FILE, CheckpointError, existing_directory
from .metadata import check_metadata, read_lora, read_metadata
from .restore import params_digest, restore_params


def load_for_sampling(directory: str | os.PathLike, mesh: Any = None, *,
                      scan_layers: bool | None = None,
                      lora: str | os.PathLike | None = None) -> tuple[Any, Any, Any]:
    """Returns `(TransformerConfig, Tokenizer, params)` from the newest step in `directory`.

    `config.json` and the tokenizer are checked against the step's manifest and the params
    against the shapes `model.init_params` gives for the config, their checksums and NaN.
    With a `mesh` (`kvjax.parallel.make_mesh`) the params are read straight into its layout
    (`parallel.state_shardings`), whatever mesh saved them; without one, onto one device.

    The layers come back held as `scan_layers` says (None: `TransformerConfig`'s default,
    unrolled), whichever way the checkpoint stores them (its `config.json` says which); the
    returned config says how they are held (`model.with_layer_layout` converts).

    With `lora`, a directory of LoRA adapters trained on this checkpoint (`kvjax train
    --lora-rank`), the params come back with the adapters merged in (`model.lora.merge`).
    The adapters must name this checkpoint's params as their base (by their checksums); a
    directory of adapters given as `directory` is refused with a message naming its base.
    """
    # Imported here so that saving and restoring training state does not depend on them.
    from kvjax.model import TransformerConfig, param_shapes, with_layer_layout
    from kvjax.tokenizer import tokenizer_from_bytes

    path = existing_directory(directory)
    config_dict, _task, tokenizer_bytes = read_metadata(path)
    check_metadata(path)
    adapters_of = read_lora(path)
    if adapters_of is not None:
        base = (adapters_of.get("base") or {}).get("checkpoint", "the base checkpoint")
        raise CheckpointError(
            f"{path} holds LoRA adapters, not a whole model: load the checkpoint they were "
            f"trained on with them (kvjax sample --checkpoint {base} --lora {path}, or "
            f"text.load({str(base)!r}, lora={str(path)!r}))")
    try:
        config = TransformerConfig.from_dict(config_dict)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config file {path / CONFIG_FILE}: invalid model config: {e}") from e
    try:
        tokenizer = tokenizer_from_bytes(tokenizer_bytes)
    except ValueError as e:
        raise CheckpointError(f"tokenizer file {path / TOKENIZER_FILE}: {e}") from e
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} pieces but the model's "
            f"vocab_size is {config.vocab_size}"
        )
    abstract_params = param_shapes(config)
    if mesh is not None:
        from kvjax import parallel

        parallel.check_model_axis(config, mesh)
        abstract_params = parallel.abstract_on(abstract_params, mesh)
    params = restore_params(path, abstract_params)
    if lora is not None:
        config, params = _with_adapters(path, config, params, lora)
    if scan_layers is None:
        scan_layers = TransformerConfig.scan_layers
    if scan_layers != config.scan_layers:
        config, params = with_layer_layout(config, params, scan_layers)
        if mesh is not None:
            params = parallel.shard_params(params, mesh)
    return config, tokenizer, params


def _with_adapters(base_path, config, params, adapter_dir) -> tuple[Any, Any]:
    """(config, params) of the base with the adapters in `adapter_dir` merged in, held in the
    layer layout the adapters were trained in. A base of int8 weights is merged as the float
    model of its dequantized weights, which its fine-tuning run trained the adapters on."""
    from kvjax.model import lora as L
    from kvjax.model import with_float_kernels, with_layer_layout

    settings, trained, adapters = _adapters_of(base_path, adapter_dir)
    if trained.kernel_dtype is None:
        config, params = with_float_kernels(config, params)
    if trained.replace(scan_layers=config.scan_layers) != config:
        raise CheckpointError(f"the LoRA adapters in {adapter_dir} were trained for another "
                              f"model config than the one of {base_path}")
    if config.scan_layers != trained.scan_layers:
        config, params = with_layer_layout(config, params, trained.scan_layers)
    return config, L.merge(config, params, adapters, settings)


def _adapters_of(base_path, adapter_dir) -> tuple[Any, Any, Any]:
    """`read_adapters`' settings, config and adapters, refused unless trained on the params
    of the checkpoint at `base_path` (where they record those params' checksum)."""
    settings, trained, base, adapters = read_adapters(adapter_dir)
    wanted = base.get("params_sha256")
    if wanted is not None and params_digest(base_path) != wanted:
        raise CheckpointError(
            f"the LoRA adapters in {adapter_dir} were trained on other params than those of "
            f"{base_path} (their base was {base.get('checkpoint')}, step {base.get('step')})")
    return settings, trained, adapters


def load_adapters(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike,
                  scan_layers: bool | None = None) -> tuple[Any, Any]:
    """(adapters, LoRA settings) of a run of `kvjax train --lora-rank` on the checkpoint in
    `base_dir`, unmerged (to serve beside others: `model.lora_rows`), their layers held as
    `scan_layers` says (None: `TransformerConfig`'s default, as `load_for_sampling`'s)."""
    from kvjax.model import TransformerConfig, stack_layer_params, unstack_layer_params

    path = existing_directory(base_dir)
    settings, trained, adapters = _adapters_of(path, adapter_dir)
    stored = TransformerConfig.from_dict(read_metadata(path)[0])
    if trained.replace(scan_layers=stored.scan_layers, kernel_dtype=stored.kernel_dtype) \
            != stored:
        raise CheckpointError(f"the LoRA adapters in {adapter_dir} were trained for another "
                              f"model config than the one of {path}")
    scan_layers = TransformerConfig.scan_layers if scan_layers is None else scan_layers
    if scan_layers != trained.scan_layers:
        adapters = (stack_layer_params if scan_layers else unstack_layer_params)(
            trained, adapters)
    return adapters, settings


def read_adapters(adapter_dir: str | os.PathLike) -> tuple[Any, Any, dict[str, Any], Any]:
    """(LoRA settings, the model config they were trained for, the base they record, the
    adapters in the layer layout they were trained in) of a run of `kvjax train
    --lora-rank`, checked against its manifest."""
    from kvjax.model import TransformerConfig, param_shapes
    from kvjax.model import lora as L

    path = existing_directory(adapter_dir)
    record = read_lora(path)
    if record is None:
        raise CheckpointError(f"{path} holds no LoRA adapters (its {CONFIG_FILE} has no "
                              "'lora'): it is a checkpoint of a whole model")
    check_metadata(path)
    try:
        settings = L.LoRA.from_dict(record)
        trained = TransformerConfig.from_dict(read_metadata(path)[0])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE}: invalid LoRA record: {e}") from e
    abstract = param_shapes(trained)
    adapters = restore_params(path, L.adapter_shapes(trained, abstract, settings))
    return settings, trained, record.get("base") or {}, adapters
