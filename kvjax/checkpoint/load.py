"""Loading a checkpoint for sampling: config, tokenizer and params, all checked."""

from __future__ import annotations

import os
from typing import Any

import jax

from .layout import CONFIG_FILE, TOKENIZER_FILE, CheckpointError, existing_directory
from .metadata import check_metadata, read_metadata
from .restore import restore_params


def load_for_sampling(directory: str | os.PathLike, mesh: Any = None, *,
                      scan_layers: bool | None = None) -> tuple[Any, Any, Any]:
    """Returns `(TransformerConfig, Tokenizer, params)` from the newest step in `directory`.

    `config.json` and the tokenizer are checked against the step's manifest and the params
    against the shapes `model.init_params` gives for the config, their checksums and NaN.
    With a `mesh` (`kvjax.parallel.make_mesh`) the params are read straight into its layout
    (`parallel.state_shardings`), whatever mesh saved them; without one, onto one device.

    The layers come back held as `scan_layers` says (None: `TransformerConfig`'s default,
    unrolled), whichever way the checkpoint stores them (its `config.json` says which); the
    returned config says how they are held (`model.with_layer_layout` converts).
    """
    # Imported here so that saving and restoring training state does not depend on them.
    from kvjax.model import TransformerConfig, init_params, with_layer_layout
    from kvjax.tokenizer import tokenizer_from_bytes

    path = existing_directory(directory)
    config_dict, _task, tokenizer_bytes = read_metadata(path)
    check_metadata(path)
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
    abstract_params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    if mesh is not None:
        from kvjax import parallel

        parallel.check_model_axis(config, mesh)
        abstract_params = parallel.abstract_on(abstract_params, mesh)
    params = restore_params(path, abstract_params)
    if scan_layers is None:
        scan_layers = TransformerConfig.scan_layers
    if scan_layers != config.scan_layers:
        config, params = with_layer_layout(config, params, scan_layers)
        if mesh is not None:
            params = parallel.shard_params(params, mesh)
    return config, tokenizer, params
