"""The module DeepSpeed trains: the HF model and the LM-head loss in one forward (``PackedCausalLM``).

The loss reads the LM head's weight itself, a chunk of tokens at a time (loss.py), so that the logits of a whole
pack never exist at once; what the model's own forward does to its logits (a scale, soft-capping) is applied there
too (compat.logit_head_of). build.py wraps it in the DeepSpeed engine; the profiler and the benches run it alone.
"""

from __future__ import annotations

import torch

from hbp_train.model import hf_model as modeling
from hbp_train.model.compat import logit_head_of
from hbp_train.model.loss import chunked_token_losses, fused_token_losses
from hbp_train.model.rope import PackSlice, has_per_sample_rope


class PackedCausalLM(torch.nn.Module):
    """The HF model plus the LM-head loss: forward(batch) -> per-token losses [T] (0 where no label), or with the
    normalizer's per-token ``loss_weights`` (the trainer's step) -> (sum_t w_t loss_t, loss_T): the scalar to call
    backward on, made by the fused head + loss when ``fused_loss`` (loss.fused_token_losses), else as the weighted
    sum of the chunked losses; loss_T is then for the statistics.

    The loss applies what the model's own forward applies to its logits (a scale, soft-capping: compat.logit_head_of),
    so that it is the model's own loss. Wrapping both in one module lets DeepSpeed see one forward; under ZeRO-3 the
    LM-head weight, used here outside its own module's forward, is registered as an external parameter
    (build_engine) so it is gathered for the loss.
    """

    def __init__(self, model, chunk_size: int, router_aux: bool = False, router_choices: bool = False,
                 fused_loss: bool = False):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        self.fused_loss = fused_loss
        self.logit_head = logit_head_of(model.config)
        """What the model's forward does to its LM head's output before the loss (loss.LogitHead)."""
        self.router_aux = router_aux
        self.router_logits = None
        """With router_aux: the last forward's router logits (one [T, E] per MoE layer) for moe.pack_aux_loss."""
        self.keep_choices = router_choices
        self.router_choices = None
        """With router_choices (DeepSeek's router loss): the experts the routers chose (one [T, k] per MoE layer)."""
        self.per_sample_rope = has_per_sample_rope(model)
        """Whether the model's RoPE depends on the sample's length (its forward then needs a pack slice, rope.py)."""

    def forward(self, input_ids, position_ids, shift_labels, cu_seqlens=None, max_seqlen=None, loss_weights=None,
                num_loss_tokens=None, pack_slice=None):
        """``num_loss_tokens``: the labels that are not IGNORE_INDEX, when the caller knows it (no host sync).
        ``pack_slice``: where the tokens lie in their pack (rope.PackSlice, the SP split's ``batch["pack_slice"]``),
        for a RoPE that depends on the sample's length (rope.py); without it the input is taken for a whole pack
        and its samples are found in position_ids (a host sync)."""
        if pack_slice is None and self.per_sample_rope:
            pack_slice = PackSlice.from_position_ids(position_ids)
        kwargs = {}
        if cu_seqlens is not None:
            kwargs = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_seqlen,
                      "max_length_k": max_seqlen}
        self.router_logits = [] if self.router_aux else None
        self.router_choices = [] if self.keep_choices else None
        hidden = modeling.forward_hidden(self.model, input_ids, position_ids, router_logits=self.router_logits,
                                         router_choices=self.router_choices, pack_slice=pack_slice, **kwargs)
        head = self.model.get_output_embeddings()
        bias = getattr(head, "bias", None)
        if loss_weights is not None and self.fused_loss:
            return fused_token_losses(hidden, head.weight, shift_labels, loss_weights, self.chunk_size,
                                      lm_head_bias=bias, num_rows=num_loss_tokens, logit_head=self.logit_head)
        loss_T = chunked_token_losses(hidden, head.weight, shift_labels, self.chunk_size, lm_head_bias=bias,
                                      num_rows=num_loss_tokens, logit_head=self.logit_head)
        if loss_weights is None:
            return loss_T
        return (loss_T * loss_weights.reshape(-1)).sum(), loss_T
