"""How config keys evolve across releases: keys that are gone (an error naming what replaced
them), keys deprecated and ignored (a warning), and keys renamed in place (read under the old
name for one release, with a warning). Applied to the raw tables before they become Structs."""

from __future__ import annotations

import warnings
from typing import Any

# Keys ``[model]`` had before every model became a directory, and what replaced each.
RETIRED_MODEL_KEYS = {
    "hf_path": "model.path",
    "family": "model.path (every model is a Hugging Face directory now; the demo's too)",
    **{key: "the model directory's config.json (model.path)"
       for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len")},
    "seed": "demo.seed (the demo model's random weights)",
}
# Other keys that were renamed or replaced, by dotted path, and what replaced each.
RETIRED_KEYS = {
    **{f"model.{key}": replacement for key, replacement in RETIRED_MODEL_KEYS.items()},
    "trainer.group_size": "trainer.n_samples_per_prompt",
    "trainer.train_truncated": 'trainer.overlong ("train" for true, "mask" for false)',
    "demo.prefetch_steps": "max_groups_ahead (of an rl stage in [[stages]], in groups)",
    # The demo is a run file now (rollmesh/deploy_defaults/demo.toml), sized by its CLI options.
    "demo.sft_steps": "the demo run file's warm_start stage steps (rollmesh demo --sft-steps)",
    "demo.sft_batch": "the demo run file's warm_start stage batch_tokens",
    "demo.sft_lr": "the demo run file's warm_start stage trainer = {lr = ...}",
    "demo.warm_start_exact_fraction": "rollmesh.demo.run_file.EXACT_FRACTION (the demonstrations' share of exact answers)",
    "demo.rl_steps": "the demo run file's rl stage steps (rollmesh demo --rl-steps)",
    "demo.eval_every": "[[eval]] eval_every (rollmesh demo --eval-every)",
    "demo.eval_size": "[[eval]] size (rollmesh demo --eval-size)",
}
# Keys still read for one release, with a DeprecationWarning, and then ignored: what they set is
# now derived, as each says.
DEPRECATED_KEYS = {
    "rollout.work_heartbeat_s": "a delivery's keepalive now beats every third of its ack wait "
                                "(nats.rollout_ack_wait_s); remove the key",
}
# Keys renamed in place, by dotted path: still read for one release under the old name, with a
# DeprecationWarning, as the new one.
RENAMED_KEYS = {
    "scheduler.elastic_decode": "scheduler.decode_loans",
    "scheduler.elastic_drain_s": "scheduler.decode_loan_drain_s",
}


def _config_error() -> type[Exception]:
    from rollmesh.config import ConfigError  # config imports this module

    return ConfigError


def refuse_retired_keys(raw: dict[str, Any], *, source: str,
                         env: dict[str, tuple[str, Any]] | None = None) -> None:
    """A key that no longer exists gets an error naming what replaced it (not msgspec's plain
    "unknown field")."""
    for dotted, replacement in RETIRED_KEYS.items():
        section, _, key = dotted.partition(".")
        table = raw.get(section)
        if isinstance(table, dict) and key in table:
            variable = (env or {}).get(dotted, (None,))[0]
            raise _config_error()(f"{dotted} is gone: use {replacement}", source=variable or source,
                              path=dotted)


def drop_deprecated_keys(raw: dict[str, Any], *, source: str) -> None:
    """Take each deprecated key out of ``raw`` (so the Structs need not know it), with a warning."""
    for dotted, instead in DEPRECATED_KEYS.items():
        section, _, key = dotted.partition(".")
        table = raw.get(section)
        if isinstance(table, dict) and key in table:
            del table[key]
            warnings.warn(f"{source}: {dotted} is deprecated and ignored: {instead}",
                          DeprecationWarning, stacklevel=3)


def rename_keys(raw: dict[str, Any], *, source: str, env: dict[str, tuple[str, Any]] | None = None) -> None:
    """Move each renamed key's value to its new name, warning; both names set is an error, since
    which one was meant cannot be told."""
    for old, new in RENAMED_KEYS.items():
        section, _, old_key = old.partition(".")
        new_section, _, new_key = new.partition(".")
        table = raw.get(section)
        if not (isinstance(table, dict) and old_key in table):
            continue
        variable = (env or {}).get(old, (None,))[0]
        if new_key in raw.get(new_section, {}):
            raise _config_error()(f"{old} and {new} are both set: {old} is the old name of {new}; keep only {new}",
                              source=variable or source, path=old)
        warnings.warn(f"{variable or source}: {old} is now {new}; the old name will be removed in the next release",
                      DeprecationWarning, stacklevel=3)
        raw.setdefault(new_section, {})[new_key] = table.pop(old_key)
