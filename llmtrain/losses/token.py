"""One token-weighted loss: the sum of per-token losses over every micro-batch and rank, divided by the
global count of trained tokens. Gradients then equal those of one big batch, whatever the split.

How the per-token losses are computed is `train.loss_impl`:
  full     the model's logits, [tokens x vocab] in fp32, then cross-entropy (what transformers does)
  chunked  the final hidden states of the trained tokens only, through the model's own output layer a
           chunk of tokens at a time; each chunk's gradient is taken at once, so neither the logits nor
           their gradient ever exist for more than one chunk. Per-token log-probs (token_logps, for
           losses such as DPO's) recompute each chunk's logits in the backward pass instead. For a
           plain nn.Linear output layer (every supported family) the gradient is written by hand:
           one fp32 buffer per chunk holds the logits, then in place their gradient
  liger    Liger Kernel's fused linear cross-entropy (CUDA only, an optional extra)
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from llmtrain.config import ConfigError
from llmtrain.data.formats import IGNORE, model_inputs
from llmtrain.models import ulysses

# fp32 logits of one chunk, turned into their gradient in place: few chunks keep the per-chunk
# accumulation of the output layer's weight gradient cheap, and one buffer stays far below the full
# path's logits, log-softmax and their gradients at a real vocabulary.
CHUNK_BYTES = 256 << 20
MIN_CHUNK_TOKENS = 64


def trained_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that carry a loss: label positions 1.. (position 0 predicts nothing) that are not ignored."""
    return (labels[:, 1:] != IGNORE).sum()


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """The labels shifted left (the last position gets IGNORE) rather than the logits sliced: slicing
    would copy the whole logits tensor, and its gradient, every step."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropies, in fp32 whatever the compute dtype."""
    return targets_loss_sum(logits, next_token_targets(labels))


def targets_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """token_loss_sum of targets already shifted (next_token_targets)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities (fp32) of the trained tokens, flat in row-major order: what TokenLoss.token_logps
    gives from the chunked path too (as minus its per-token cross-entropies). temperature: of the
    distribution the tokens were sampled from, logits / temperature (as TRL scores GRPO completions)."""
    return targets_logps(logits, next_token_targets(labels), temperature)


def targets_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """token_logps of targets already shifted (next_token_targets)."""
    keep = targets != IGNORE
    logits = logits[keep].float()
    return -F.cross_entropy(logits / temperature if temperature != 1 else logits, targets[keep], reduction="none")


def check(impl: str, device_type: str) -> None:
    """Before any process group exists: liger needs CUDA and the liger-kernel package."""
    if impl != "liger":
        return
    if device_type != "cuda":
        raise ConfigError(f"train.loss_impl=liger runs Triton kernels on CUDA; this run is on {device_type}: "
                          "use train.loss_impl=chunked (same memory saving, any device) or full")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("train.loss_impl=liger needs the liger-kernel package (pip install 'llmtrain[liger]'); "
                          "or use train.loss_impl=chunked")


def _causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers model with the output layer, inside any DDP / FSDP1 / PEFT wrapper."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.get_output_embeddings() is not None:
            return module
    raise ConfigError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None): "
                      "use train.loss_impl=full")


class TokenLoss:
    """`loss_sum(model, batch)`: the summed next-token loss of one micro-batch, by `train.loss_impl`;
    `token_logps(model, batch)`: the log-prob of each trained token (liger: refused).

    chunked and liger run inside the model's own forward, so that FSDP1/FSDP2 hold the output layer
    gathered (once per micro-batch) and register their backward hooks on the loss, which the forward
    returns: `logits_to_keep` (a mask of the trained positions) makes the model hand exactly their final
    hidden states to its output layer; a pre-hook on that layer takes them and passes it zero rows
    instead, and the model's `loss_function`, swapped for the call, returns the loss computed from them."""

    def __init__(self, impl: str, model: nn.Module, device: torch.device, chunk_tokens: int = 0,
                 sp_group: dist.ProcessGroup | None = None):
        self.impl = impl
        self.sp_group = sp_group  # parallel.sp_size > 1: each forward runs on this rank's slice of the rows
        self.lm = _causal_lm(model)
        cap = getattr(self.lm.config, "final_logit_softcapping", None)  # Gemma 2 / 3
        self.softcap = float(cap) if cap else None
        self.vocab_size = self.lm.config.get_text_config().vocab_size  # a VLM's: its language model's
        self.chunk_tokens = chunk_tokens or max(MIN_CHUNK_TOKENS, CHUNK_BYTES // (4 * self.vocab_size))
        # A plain nn.Linear output layer gets the hand-written gradient (_linear_head_grads) and liger; any
        # other (PEFT's, say) has its own math, which only autograd through the module reproduces.
        self.plain_head = type(self.lm.get_output_embeddings()) is nn.Linear
        if impl != "full":
            self._check_head(model, device)

    def describe(self) -> str:
        if self.impl == "full":
            return "loss: full logits (train.loss_impl=full)"
        extra = f", final logit soft-capping {self.softcap:g}" if self.softcap else ""
        return (f"loss: {self.impl} (train.loss_impl={self.impl}: logits of at most {self.chunk_tokens} trained "
                f"tokens at a time{extra})")

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the model's forward does after its last norm: the output layer (the module, so that
        wrappers such as PEFT's apply), then any soft-capping."""
        logits = self.lm.get_output_embeddings()(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @contextlib.contextmanager
    def _in_forward(self, on_hidden):
        """For one model call: on_hidden(rows) gets what the model passes to its output layer, and its
        result replaces them; the model's loss is what on_hidden stored in self._loss."""
        def once(module, args):
            handle.remove()  # on_hidden calls the layer itself
            return on_hidden(args[0]), *args[1:]

        handle = self.lm.get_output_embeddings().register_forward_pre_hook(once)
        self.lm.loss_function = lambda *args, **kwargs: self._loss
        try:
            yield
        finally:
            handle.remove()
            del self.lm._loss_function
            self._loss = None

    @torch.no_grad()
    def _check_head(self, model: nn.Module, device: torch.device) -> None:
        """One tiny forward (every rank: it is collective under FSDP): the model's own last logit against
        head_logits() of the same hidden state. A family that transforms logits in a way not reproduced
        here (a logit scale, say) is refused before training."""
        ours = []

        def probe(hidden):
            ours.append(self.head_logits(hidden).float())
            self._loss = None
            return hidden

        with self._in_forward(probe):
            # Several distinct tokens: a padding id's embedding may be zero, and zero logits hide any scale.
            ids = torch.arange(1, 5, device=device).remainder(self.vocab_size)[None]
            with torch.compiler.set_stance("force_eager"):  # parallel.compile: no compile (under no_grad) for it
                out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
        if not torch.allclose(ours[0], out.logits.float(), rtol=1e-3, atol=1e-4):
            raise ConfigError(f"train.loss_impl={self.impl}: {type(self.lm).__name__} transforms its logits after "
                              "the output layer in a way llmtrain does not reproduce; use train.loss_impl=full")

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """The summed next-token loss of the rows (under a sequence split: of the whole rows, on every rank of the
        group, its gradient to this rank's slice: ulysses.whole)."""
        with self.split(batch) as part:
            if self.impl == "full":
                return part.whole(targets_loss_sum(self._logits(model, batch, part), part.targets))
            return part.whole(self._on_rows(model, batch, part, self._liger if self.impl == "liger" else self._chunked))

    def token_logps(self, model: nn.Module, batch: dict, temperature: float = 1.0) -> torch.Tensor:
        """Log-probs (fp32) of the trained tokens, flat in row-major order (token_logps() of the full logits),
        differentiable for any downstream loss (DPO's, GRPO's): chunked, they are computed a chunk at a time
        with no logits kept, and each chunk's logits are recomputed in the backward pass. temperature divides
        the logits (after any soft-capping), as TRL does for GRPO's sampled completions."""
        if self.impl == "liger":  # recipes refuse it before start-up; this names the reason for library callers
            raise ConfigError("train.loss_impl=liger yields only a summed loss, not per-token log-probs; "
                              "use train.loss_impl=chunked or full")
        with self.split(batch) as part:  # under a sequence split: the whole rows' tokens (Split.whole_tokens)
            if self.impl == "full":
                return part.whole_tokens(targets_logps(self._logits(model, batch, part), part.targets, temperature))
            return part.whole_tokens(self._on_rows(model, batch, part,
                                                   lambda hidden, flat: self._chunked_logps(hidden, flat, temperature)))

    @torch.no_grad()
    def greedy_hits(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """[rows, positions] bool: whether each trained position's target is the model's most likely next token
        (True where nothing is trained). Whole rows only (no sequence split)."""
        targets = next_token_targets(batch["labels"])
        keep = targets != IGNORE
        if self.impl == "full":
            return ~keep | (model(**model_inputs(batch), use_cache=False).logits.argmax(-1) == targets)

        def hits(hidden, flat):
            return torch.cat([self.head_logits(hidden[r]).argmax(-1) == flat[r] for r in self._chunks(len(flat))])
        out = ~keep
        out[keep] = self.on_trained_rows(model, batch, hits)
        return out

    def split(self, batch: dict):
        """The rows' inputs and next-token targets (ulysses.Split): this rank's slice of them under a sequence
        split, active for the forwards inside the block; the whole rows otherwise."""
        return ulysses.split(self.sp_group, batch["input_ids"], batch.get("position_ids"),
                             next_token_targets(batch["labels"]), IGNORE)

    @staticmethod
    def _inputs(batch: dict, part: ulysses.Split) -> dict:
        """The forward's inputs: every model input of the rows (data.formats.model_inputs: a VLM's pixel values
        too), with this rank's slice of the ids and positions under a sequence split (text rows only)."""
        inputs = model_inputs(batch)
        if part.group is not None:
            inputs |= {"input_ids": part.input_ids, "position_ids": part.position_ids}
        return inputs

    def _logits(self, model: nn.Module, batch: dict, part: ulysses.Split) -> torch.Tensor:
        return model(**self._inputs(batch, part), use_cache=False).logits

    def on_trained_rows(self, model: nn.Module, batch: dict, fn) -> torch.Tensor:
        """The model's forward, returning fn(final hidden states of the trained positions, their targets)
        (this rank's positions under a sequence split: what fn returns is this slice's)."""
        with self.split(batch) as part:
            return self._on_rows(model, batch, part, fn)

    def _on_rows(self, model: nn.Module, batch: dict, part: ulysses.Split, fn) -> torch.Tensor:
        keep = part.targets != IGNORE  # untrained positions (prompt, padding) never reach the output layer
        flat = part.targets[keep]

        def on_hidden(hidden):
            self._loss = fn(hidden, flat)
            return hidden[:0]

        with self._in_forward(on_hidden):
            return model(**self._inputs(batch, part), use_cache=False, labels=part.targets, logits_to_keep=keep).loss

    def whole(self, value: torch.Tensor) -> torch.Tensor:
        """Sums over this rank's slice of the rows (on_trained_rows') -> the whole rows' (ulysses.whole)."""
        return ulysses.whole(self.sp_group, value)

    def chunk_logps(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Log-probs (fp32) of targets under head_logits(hidden) / temperature, for one chunk of rows."""
        logits = self.head_logits(hidden).float()
        return -F.cross_entropy(logits / temperature if temperature != 1 else logits, targets, reduction="none")

    def _chunked(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return -self._no_grad_logps(hidden, targets).sum()
        return _ChunkedHeadLoss.apply(self, hidden, targets, *self.head_inputs(hidden))

    def _chunked_logps(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        if not torch.is_grad_enabled():  # e.g. DPO's reference: nothing to recompute
            return self._no_grad_logps(hidden, targets, temperature)
        return _ChunkedHeadLogps.apply(self, hidden, targets, temperature, *self.head_inputs(hidden))

    def head_inputs(self, hidden: torch.Tensor) -> list[torch.Tensor | None]:
        """What the chunked Functions take the output layer's gradient for: a plain nn.Linear's own weight
        and bias (plain, FSDP2's gathered or FSDP1's views of its flat parameter: autograd carries their
        gradients on to the wrappers), else the leaves its graph reaches."""
        head = self.lm.get_output_embeddings()
        return [head.weight, head.bias] if self.plain_head else _trainable_leaves(self, hidden[:1])

    @torch.no_grad()
    def _no_grad_logps(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return torch.cat([self.chunk_logps(hidden[rows], targets[rows], temperature)
                          for rows in self._chunks(len(targets))])

    def _chunks(self, n: int) -> list[slice]:
        """Row ranges of at most chunk_tokens; one empty range when n is 0 (a batch with nothing trained)."""
        return [slice(start, start + self.chunk_tokens) for start in range(0, max(n, 1), self.chunk_tokens)]

    def _liger(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        head = self.lm.get_output_embeddings()
        if not self.plain_head:  # Liger reads the weight directly: a wrapper's own math would be lost
            raise ConfigError(f"train.loss_impl=liger needs a plain nn.Linear output layer, not {type(head).__name__}"
                              "; use train.loss_impl=chunked")
        fused = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum", softcap=self.softcap)
        return fused(head.weight, hidden, targets, head.bias)


def _trainable_leaves(loss: TokenLoss, probe: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors the output layer's gradient reaches, found in the autograd graph of one row:
    parameters (tied or not, LoRA's, FSDP2's gathered ones) or FSDP1's flat parameter, whose views the
    layer uses. They become inputs of _ChunkedHeadLoss so that their gradients arrive in the real
    backward pass, where the wrappers' hooks (reduce-scatter, DDP buckets, no_sync) expect them."""
    with torch.enable_grad():
        out = loss.head_logits(probe.detach())
    leaves, seen, todo = [], set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad
            leaves.append(node.variable)
        todo.extend(fn for fn, _ in node.next_functions)
    return leaves


def _head_grads(loss: TokenLoss, hidden: torch.Tensor, targets: torch.Tensor, leaves: list[torch.Tensor],
                weights: torch.Tensor | None, temperature: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Chunk by chunk: the log-probs of targets under head_logits(hidden) / temperature, and the gradients
    of sum(weights x log-probs) w.r.t. the hidden rows and the head's leaves (weights None: all -1, i.e.
    the summed cross-entropy's). Only one chunk's logits exist at a time."""
    if loss.plain_head:
        return _linear_head_grads(loss, hidden, targets, *leaves, weights, temperature)
    grad_hidden = torch.zeros_like(hidden)
    grad_leaves = [None] * len(leaves)
    logps = []
    for rows in loss._chunks(len(targets)):
        with torch.enable_grad():
            h = hidden[rows].detach().requires_grad_()
            chunk = loss.chunk_logps(h, targets[rows], temperature)
        grads = torch.autograd.grad(chunk, [h, *leaves], -torch.ones_like(chunk) if weights is None else weights[rows])
        grad_hidden[rows] = grads[0]
        for i, g in enumerate(grads[1:]):
            grad_leaves[i] = g if grad_leaves[i] is None else grad_leaves[i].add_(g)
        logps.append(chunk.detach())
    return torch.cat(logps), grad_hidden, grad_leaves


def _linear_head_grads(loss: TokenLoss, hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, weights: torch.Tensor | None, temperature: float = 1.0):
    """_head_grads for a plain nn.Linear, with the cross-entropy's gradient written out: one fp32 buffer per
    chunk holds the logits z, then e = exp(z - max) in place (one exp pass; log p = z_t - max - log s with
    s the row sum of e), then e - s one-hot, whose row scale -weight / s is applied to the small operands
    of the two matmuls; the weight's gradient accumulates in place (addmm_). Autograd would make the
    log-softmax, its gradient and a weight gradient per chunk to add. A temperature divides z (after any
    soft-capping) in place, and its 1 / temperature joins the row scale."""
    dtype = _compute_dtype(hidden)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        h_all, w = hidden.detach().to(dtype), weight.detach().to(dtype)
        b = None if bias is None else bias.detach().to(dtype)
        grad_hidden = torch.empty_like(h_all)
        grad_w = torch.zeros_like(w) if weight.requires_grad else None
        grad_b = torch.zeros_like(b) if bias is not None and bias.requires_grad else None
        logps = []
        for rows in loss._chunks(len(targets)):
            h, t = h_all[rows], targets[rows]
            z = F.linear(h, w, b).float()
            if loss.softcap:
                capped = torch.tanh(z / loss.softcap)
                z = capped * loss.softcap
            if temperature != 1:
                z.div_(temperature)
            picked, top = z.gather(1, t[:, None]), z.amax(1, keepdim=True)
            e = z.sub_(top).exp_()
            s = e.sum(1, keepdim=True)
            logps.append((picked - top - s.log()).squeeze(1))
            # d(weight x log p)/dz = weight (one-hot - softmax) = (-weight / s) (e - s one-hot)
            e[torch.arange(len(t), device=t.device), t] -= s.squeeze(1)
            if loss.softcap:
                e.mul_(capped.square_().neg_().add_(1))  # d tanh(x) = 1 - tanh(x)^2
            scale = ((1 if weights is None else -weights[rows, None]) / s).to(dtype)  # weights None: -1
            if temperature != 1:
                scale = scale / temperature
            e = e.to(dtype)
            torch.mm(e, w, out=grad_hidden[rows]).mul_(scale)
            if grad_w is not None:
                grad_w.addmm_(e.T, h * scale)
            if grad_b is not None:
                grad_b += (scale.T @ e).squeeze(0)
    grads = [None if g is None else g.to(p.dtype) for g, p in ((grad_w, weight), (grad_b, bias))]
    return torch.cat(logps), grad_hidden.to(hidden.dtype), grads


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """What nn.Linear computes in here: autocast's dtype when it is on, else the tensor's own."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum of cross-entropies of head_logits(hidden) against targets, chunk by chunk. Forward takes each
    chunk's gradients (w.r.t. its hidden rows and the head's leaves) right away and keeps only those;
    backward scales them by the incoming gradient. The head runs forward once, as in the full path."""

    @staticmethod
    def forward(ctx, loss: TokenLoss, hidden: torch.Tensor, targets: torch.Tensor, *leaves: torch.Tensor):
        logps, grad_hidden, grad_leaves = _head_grads(loss, hidden, targets, leaves, None)
        ctx.save_for_backward(grad_hidden, *grad_leaves)
        return -logps.sum()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # In place: these buffers are this call's alone (a weight gradient is vocab x hidden).
        grad_hidden, *grad_leaves = ctx.saved_tensors
        return None, grad_hidden.mul_(grad_out), None, *(None if g is None else g.mul_(grad_out) for g in grad_leaves)


class _ChunkedHeadLogps(torch.autograd.Function):
    """Per-token log-probs of targets under head_logits(hidden). Their downstream gradient is known only
    once the whole forward is done (a DPO loss pairs rows), so forward keeps no logits and backward
    recomputes them chunk by chunk (under the forward's autocast), inside the model's backward pass."""

    @staticmethod
    def forward(ctx, loss: TokenLoss, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                *leaves: torch.Tensor):
        device = hidden.device.type
        # The leaves as references, not saved tensors: FSDP may refill an unsharded parameter in place
        # between forward and backward, which a saved tensor's version check would refuse.
        ctx.loss, ctx.leaves, ctx.temperature = loss, leaves, temperature
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.save_for_backward(hidden, targets)
        return loss._no_grad_logps(hidden, targets, temperature)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, targets = ctx.saved_tensors
        device, dtype, enabled = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            _, grad_hidden, grad_leaves = _head_grads(ctx.loss, hidden, targets, ctx.leaves, grad_out,
                                                      ctx.temperature)
        return None, grad_hidden, None, None, *grad_leaves


@torch.no_grad()
def validation_sums(model, batches, device: torch.device, width: int, sums,
                    sp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The sum over every rank's validation batches of sums(batch) (a [width] tensor, or None for a batch that
    counts nothing), the model in eval mode meanwhile. sp_group: the sequence group whose ranks hold the same
    rows and the same (whole rows') sums, counted once. Collective: every rank must pass the same number of
    batches."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(width, dtype=torch.float64, device=device)
    for batch in batches:
        if (part := sums({k: v.to(device) for k, v in batch.items()})) is not None:
            totals += part.double()
    totals = ulysses.once(sp_group, totals)
    dist.all_reduce(totals)
    model.train(was_training)
    return totals


def answer_accuracy(model, batches, device: torch.device, autocast, loss: TokenLoss) -> float:
    """The share of validation rows (one example each) whose every trained token is the model's most likely next
    token: those whose answer greedy decoding reproduces exactly. Collective, as evaluate."""
    def sums(batch: dict) -> torch.Tensor:
        with autocast():
            hits = loss.greedy_hits(model, batch)
        rows = (next_token_targets(batch["labels"]) != IGNORE).any(-1)
        return torch.stack([(hits.all(-1) & rows).sum(), rows.sum()])
    totals = validation_sums(model, batches, device, 2, sums)
    return (totals[0] / totals[1].clamp(min=1)).item()


def evaluate(model, batches, device: torch.device, autocast, loss: TokenLoss) -> tuple[float, int]:
    """Token-weighted loss over every rank's validation batches: (global mean loss, global tokens).
    Collective: every rank must pass the same number of batches."""
    def sums(batch: dict) -> torch.Tensor:
        with autocast():
            return torch.stack([loss.loss_sum(model, batch).double(), trained_tokens(batch["labels"]).double()])
    totals = validation_sums(model, batches, device, 2, sums, loss.sp_group)
    return (totals[0] / totals[1].clamp(min=1)).item(), int(totals[1].item())
