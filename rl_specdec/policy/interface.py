"""What the training loop sees of the policy: one object, however many workers train it.

Batch layout (right-padded, ``N`` sequences of length ``T``)::

    input_ids      [N, T]    prompt + response token ids
    attention_mask [N, T]    1 on real tokens
    loss_mask      [N, T-1]  1 where token t+1 is a response token (the ones we score)
    + any per-token [N, T-1] or per-sequence [N] tensors the loss needs

``token_logprobs[n, t]`` is log p(input_ids[n, t+1] | input_ids[n, :t+1]).

The loss is *given* to ``train_step`` by the caller (this package knows
nothing of GRPO). It must normalise by the whole batch, e.g. divide by the
batch's total response tokens carried in every row of the batch, so that its
values summed over micro-batches, and over data-parallel workers, give the
full-batch loss. A row whose ``loss_mask`` is all zero must add nothing to the
loss (the data-parallel group pads with such rows).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

import torch

# loss_fn(token_logprobs [n, T-1], micro_batch, ref_logprobs or None) -> (scalar loss, {name: scalar tensor})
LossFn = Callable[
    [torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None], tuple[torch.Tensor, dict[str, torch.Tensor]]
]


class PolicyInterface(Protocol):
    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]: ...

    def get_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def state_dict_for_refit(self) -> Any:
        """An ObjectRef of the whole Hugging Face-named state dict (CPU tensors)."""
        ...

    def state_dict_buckets(self) -> Iterator[Any]:
        """ObjectRefs of dicts of at most ``policy.refit_bucket_bytes`` each; together the whole state dict."""
        ...

    def head_result(self) -> dict[str, float]:
        """The EAGLE-3 head's last step, when the policy trains one (rl_specdec.heads.training); else {}."""
        ...

    def head_state_dict_for_refit(self) -> Any:
        """The head's tensors under vLLM's names, or None without a head."""
        ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def shutdown(self) -> None: ...
