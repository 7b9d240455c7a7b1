"""Keep a multi-turn trajectory's token ids monotonic: splice the model's own tokens into the history.

An OpenAI-style server speaks text. In a multi-turn conversation the client
sends the whole history back as messages, and the server renders it with the
chat template and tokenises it again. The re-tokenised history need not be
the tokens the model produced: a string can tokenise several ways, templates
normalise whitespace, and many templates *drop* earlier reasoning blocks when
they re-render the history. Training on such a trajectory is off-policy (the
log-probs were computed for different tokens) and the token ids of turn 2 are
no longer an extension of turn 1's.

:func:`replace_prefix_tokens` fixes the prompt of the next turn: it keeps the
exact tokens the model saw and produced up to the end of its last turn, and
takes everything after that turn's boundary (the EOS token the template puts
at the end of an assistant turn) from the template::

    model_prefix    = previous prompt ids + previous generated ids  (exact, on-policy)
    template_prefix = template(messages up to that assistant turn)  (re-tokenised)
    template        = template(all messages, generation prompt)     (re-tokenised)

    result = model_prefix (without its final EOS) + template[from the k-th EOS on]

where ``k`` is the number of EOS tokens in ``template_prefix``, i.e. the last
assistant turn's boundary is found by *counting* turn boundaries, not by
position. Counting is what makes it robust to templates that strip earlier
reasoning from re-rendered history: the stripped content shifts every later
position, but it does not remove turn boundaries. (Finding the boundary by
its position in ``template_prefix`` would land inside the new user turn when
the template is shorter than the prefix and turns end with EOS.)

When the model's last turn stopped at ``max_tokens`` without an EOS, the
model prefix is kept whole and the template's EOS follows it, so the result
still starts with every token the model produced.

This is NeMo-RL's ``_replace_prefix_tokens`` (vllm_worker_async.py), with the
boundary found by count instead of position and with explicit errors.
"""

from __future__ import annotations

from typing import Any, Sequence

from rl_specdec.errors import PrefixSpliceError

__all__ = ["PrefixSpliceError", "replace_prefix_tokens"]


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise PrefixSpliceError(
            "replace_prefix_tokens needs a tokenizer with an EOS token (tokenizer.eos_token_id is None): "
            "the EOS token that ends an assistant turn is how the model's turn is located in the "
            "re-rendered history. Set the tokenizer's eos_token to the token your chat template ends "
            "assistant turns with (e.g. <|im_end|> for Qwen chat models)."
        )
    if isinstance(eos, (list, tuple)):  # some configs list several; a tokenizer exposes one
        raise PrefixSpliceError(f"tokenizer.eos_token_id must be a single id, got {eos!r}")
    return int(eos)


def replace_prefix_tokens(
    tokenizer: Any,
    model_prefix_token_ids: Sequence[int],
    template_prefix_token_ids: Sequence[int],
    template_token_ids: Sequence[int],
) -> list[int]:
    """Prompt ids for the next turn: the model's exact prefix + the template's new turns.

    Args:
        tokenizer: anything with ``eos_token_id`` (the id that ends an assistant turn).
        model_prefix_token_ids: the previous call's prompt ids followed by the ids the
            model generated (with its final EOS if it emitted one).
        template_prefix_token_ids: the chat template's rendering of the messages up to
            and including that assistant turn (no generation prompt).
        template_token_ids: the chat template's rendering of all messages, with the
            generation prompt: the prompt the server would otherwise send.

    Returns:
        ``model_prefix`` without its final EOS, followed by ``template_token_ids`` from
        the boundary (EOS) that ends the same assistant turn. With an empty
        ``model_prefix_token_ids`` (first turn) the template ids are returned unchanged.

    Raises:
        PrefixSpliceError: the tokenizer has no EOS, the template prefix has no turn
            boundary (EOS), or the full template has fewer boundaries than its prefix.

    Example (eos = 2)::

        >>> replace_prefix_tokens(tok, [11, 12, 13, 40, 41, 220, 17, 2],
        ...                       [11, 12, 13, 40, 41, 1001, 2],
        ...                       [11, 12, 13, 40, 41, 1001, 2, 21, 22, 40, 41])
        [11, 12, 13, 40, 41, 220, 17, 2, 21, 22, 40, 41]
    """
    template = [int(t) for t in template_token_ids]
    if not model_prefix_token_ids:
        return template
    eos = _eos_id(tokenizer)
    model = [int(t) for t in model_prefix_token_ids]
    if model[-1] == eos:  # the template supplies the turn's EOS (the same id)
        model = model[:-1]

    k = sum(1 for t in template_prefix_token_ids if int(t) == eos)
    if k == 0:
        raise PrefixSpliceError(
            f"the chat template's rendering of the history has no turn boundary (no EOS token, id {eos}) "
            "after the assistant's turn, so the model's tokens cannot be spliced in. Use a chat template "
            "that ends each assistant message with the tokenizer's EOS token."
        )
    seen = 0
    for pos, t in enumerate(template):
        if t == eos:
            seen += 1
            if seen == k:
                return model + template[pos:]
    raise PrefixSpliceError(
        f"the rendered history has {k} turn boundaries (EOS id {eos}) up to the assistant's last turn, "
        f"but the full rendered conversation has only {seen}: the chat template renders the history "
        "inconsistently between calls."
    )
