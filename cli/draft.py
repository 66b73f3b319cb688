"""--draft-model on the command line: whatever it names (a Hydra checkpoint, a Hugging
Face model directory, a GGUF file) becomes a Hydra checkpoint, converted once and cached,
before an engine or a service loads it: they load only Hydra checkpoints."""

from __future__ import annotations

from hydra_jury.cli.args import log


def resolved_draft_model(source: str | None) -> str | None:
    """The Hydra checkpoint of the draft model `source` (None: no draft model)."""
    if not source:
        return None
    # The builder only where there is a draft model: a service started without one never
    # loads the conversion tooling.
    from hydra_jury.hydra_model.build.draft import default_draft_cache, resolve_draft_model

    return str(resolve_draft_model(source, default_draft_cache(), log=log))
