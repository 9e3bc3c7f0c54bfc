"""The LM head's chunked autograd: token log-probs and SDPO's top-K loss straight from hidden states.

The formulas are losses.py's (`token_logprobs`, `entropy_from_logits`, `topk_with_tail`,
`sdpo_divergence`); this file computes the same values and gradients without ever holding the
[N, V] logits of a batch: the head runs on chunks of rows, forward keeps only what backward
needs (each row's logsumexp, the top-K ids), and backward re-runs the head (in vocabulary
blocks where that is cheaper). tests/test_losses.py checks each against the plain autograd
of the formula, by gradcheck and in bfloat16. Why and what it saves: docs/loop.md.

Shape letters as in losses.py: N flattened tokens, V vocabulary, H hidden size, K top-K size.
"""

import torch

from losses import support_logprobs, sdpo_divergence

# -----------------------------------------------------------------------------
# low-memory top-K distillation straight from hidden states
#
# Each chunk of rows gets its logits written into one reused [chunk_size, V] buffer per
# model (fresh multi-GB allocations are paid in page faults on every step on CPU, and
# in allocator churn on GPU), and every [n, V] operation after the matmul is in place.


def _logits_into(buffer, hidden, weight, temperature, low_precision_buffer, shift=None):
    """buffer[:n] <- hidden [n, H] @ weight [V, H]^T / temperature (- shift [n, 1]), in
    float32 or float64. The shift is folded into the matmul where the dtype allows.
    """
    n = hidden.shape[0]
    if low_precision_buffer is None and shift is not None:
        return torch.addmm(-shift, hidden, weight.T, alpha=1.0 / temperature, out=buffer[:n])
    if low_precision_buffer is None:
        logits = torch.mm(hidden, weight.T, out=buffer[:n])
    else:  # bf16/fp16 matmul, then upcast: logsumexp over 150k entries in bf16 is too coarse
        logits = buffer[:n].copy_(torch.mm(hidden, weight.T, out=low_precision_buffer[:n]))
    if temperature != 1.0:
        logits.div_(temperature)
    if shift is not None:
        logits.sub_(shift)
    return logits


def _exp_shifted_(logits, row_max=None):
    """In place: logits [n, V] <- exp(logits - rowmax). Returns (logsumexp [n, 1], row sums
    [n, 1]); softmax = logits / row sums afterwards.
    """
    row_max = logits.amax(-1, keepdim=True) if row_max is None else row_max
    row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)  # all -inf rows: lse -inf, not NaN
    row_sum = logits.sub_(row_max).exp_().sum(-1, keepdim=True)
    return row_max + row_sum.log(), row_sum


def _support_grads(student_top, student_lse, teacher_support, alpha, add_tail, grad_losses):
    """Divergence on one chunk's small supports, and the gradient of sum(grad_losses * loss)
    w.r.t. the student's top-K logits [n, K] and full logsumexp [n, 1].
    Returns (loss [n], grad_top [n, K], grad_lse [n, 1]).
    """
    with torch.enable_grad():
        student_top = student_top.detach().requires_grad_(True)
        student_lse = student_lse.detach().requires_grad_(True)
        loss = sdpo_divergence(support_logprobs(student_top, student_lse, add_tail), teacher_support, alpha)
        grad_top, grad_lse = torch.autograd.grad(loss, (student_top, student_lse), grad_losses)
    return loss.detach(), grad_top, grad_lse


def _backprop_chunk(softmax_scaled, ids, grad_top, temperature, rows, hidden, weight, grads, low_precision_buffer):
    """Chain one chunk's support gradients to the inputs. softmax_scaled [n, V] holds
    softmax(z) * grad_lse already (the logsumexp's gradient), the top-K ids add grad_top,
    and z = raw / temperature scales all by 1/temperature. Then through
    logits = hidden @ weight^T: grad_hidden[rows] = G @ W, grad_weight += G^T @ hidden.
    """
    grad_logits = softmax_scaled.scatter_add_(-1, ids, grad_top)
    if temperature != 1.0:
        grad_logits.div_(temperature)
    grad_hidden, grad_weight, weight_scratch = grads
    if low_precision_buffer is not None:
        grad_logits = low_precision_buffer[: grad_logits.shape[0]].copy_(grad_logits)
    if grad_hidden is not None:
        grad_hidden[rows] = grad_logits @ weight
    if grad_weight is None:
        return
    if weight_scratch is None:
        grad_weight.addmm_(grad_logits.T, hidden[rows])
    else:  # low precision: matmul in the weight dtype, accumulate over chunks in float32
        grad_weight.add_(torch.mm(grad_logits.T, hidden[rows], out=weight_scratch))


class _TopKDistillFromHidden(torch.autograd.Function):
    """Chunked top-K SDPO loss; see sdpo_topk_loss_from_hidden.

    Per-token mode (token_weights is None): forward keeps only the top-K ids and logits
    [N, K], the student's logsumexp [N, 1] and the teacher's support log-probs [N, K(+1)];
    backward re-runs the student matmul (in vocab blocks), because the weight gradient
    needs the [N, V] logit gradient scaled by a grad_output that forward cannot know.
    Weighted mode: the weights are known in forward, so forward also builds both
    gradients and backward only scales them by the scalar grad_output.
    """

    @staticmethod
    def forward(ctx, student_hidden, student_weight, teacher_hidden, teacher_weight, token_weights,
                k, alpha, add_tail, temperature, chunk_size, teacher_mix):
        num_tokens = student_hidden.shape[0]
        work_dtype = torch.promote_types(student_hidden.dtype, torch.float32)
        new = dict(device=student_hidden.device)
        student_buffer, low_precision_buffer = _chunk_buffers(student_hidden, student_weight, chunk_size, work_dtype)
        teacher_buffer = torch.empty_like(student_buffer)
        weighted = token_weights is not None
        if weighted:  # (grad_hidden, grad_weight, a low-precision weight's matmul scratch), where needed
            need_hidden_grad, need_weight_grad = ctx.needs_input_grad[:2]
            low_precision = student_weight.dtype != work_dtype
            grads = (torch.zeros_like(student_hidden, dtype=work_dtype) if need_hidden_grad else None,
                     torch.zeros_like(student_weight, dtype=work_dtype) if need_weight_grad else None,
                     torch.empty_like(student_weight) if need_weight_grad and low_precision else None)
        else:
            topk_ids = torch.empty(num_tokens, k, dtype=torch.long, **new)
            student_tops = torch.empty(num_tokens, k, dtype=work_dtype, **new)
            teacher_supports = torch.empty(num_tokens, k + 1 if add_tail else k, dtype=work_dtype, **new)
            student_lses = torch.empty(num_tokens, 1, dtype=work_dtype, **new)
        losses = torch.empty(num_tokens, dtype=work_dtype, **new)

        for start in range(0, num_tokens, chunk_size):
            rows = slice(start, min(start + chunk_size, num_tokens))
            student_logits = _logits_into(student_buffer, student_hidden[rows], student_weight, temperature,
                                          low_precision_buffer)
            student_top, ids = student_logits.topk(k, dim=-1)
            teacher_logits = _logits_into(teacher_buffer, teacher_hidden[rows], teacher_weight, temperature,
                                          low_precision_buffer)
            if teacher_mix:  # trust-region teacher: lerp(ref, student, r), student side detached
                teacher_logits.lerp_(student_logits, teacher_mix)
            teacher_top = teacher_logits.gather(-1, ids)
            teacher_support = support_logprobs(teacher_top, _exp_shifted_(teacher_logits)[0], add_tail)
            student_lse, student_row_sum = _exp_shifted_(student_logits, row_max=student_top[:, :1])
            if not weighted:
                student_support = support_logprobs(student_top, student_lse, add_tail)
                losses[rows] = sdpo_divergence(student_support, teacher_support, alpha)
                topk_ids[rows], student_tops[rows], student_lses[rows] = ids, student_top, student_lse
                teacher_supports[rows] = teacher_support
                continue
            weights = token_weights[rows].to(work_dtype)
            losses[rows], grad_top, grad_lse = _support_grads(student_top, student_lse, teacher_support, alpha,
                                                              add_tail, weights)
            softmax_scaled = student_logits.mul_(grad_lse / student_row_sum)
            _backprop_chunk(softmax_scaled, ids, grad_top, temperature, rows, student_hidden, student_weight, grads,
                            low_precision_buffer)

        ctx.config = (alpha, add_tail, temperature, chunk_size, weighted)
        ctx.input_dtypes = (student_hidden.dtype, student_weight.dtype)
        ctx.backward_done = False
        if weighted:
            ctx.save_for_backward(grads[0], grads[1])
            return (losses * token_weights.to(work_dtype)).sum()
        ctx.save_for_backward(student_hidden, student_weight, topk_ids, student_tops, student_lses, teacher_supports)
        return losses

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        alpha, add_tail, temperature, chunk_size, weighted = ctx.config
        if weighted:
            # scaled in place to avoid a second [V, H] buffer, so a second backward
            # through the same graph (retain_graph=True) would be wrong: refuse it
            if ctx.backward_done:
                raise RuntimeError("weighted sdpo_topk_loss_from_hidden supports a single backward")
            ctx.backward_done = True
            grad_hidden, grad_weight = (None if g is None else g.mul_(grad_output) for g in ctx.saved_tensors)
        else:  # the divergence's gradients w.r.t. the top-K logits and logsumexp, chained to the inputs
            hidden, weight, topk_ids, student_tops, student_lses, teacher_supports = ctx.saved_tensors
            _, grad_top, grad_lse = _support_grads(student_tops, student_lses, teacher_supports, alpha,
                                                   add_tail, grad_output.to(teacher_supports.dtype))
            grad_hidden, grad_weight = _head_grads_by_vocab_blocks(
                hidden, weight, student_lses, grad_lse, topk_ids, grad_top, temperature, chunk_size,
                *ctx.needs_input_grad[:2])
        return _cast_grads(grad_hidden, grad_weight, ctx.input_dtypes) + (None,) * 9


def _cast_grads(grad_hidden, grad_weight, dtypes) -> tuple:
    """The gradients (None where not needed) in the inputs' dtypes."""
    return tuple(None if g is None else g.to(dtype) for g, dtype in zip((grad_hidden, grad_weight), dtypes))


def _head_grads_by_vocab_blocks(hidden, weight, lses, grad_lse, ids, grad_ids, temperature, chunk_size,
                                need_hidden_grad, need_weight_grad):
    """Gradients through z = hidden [N, H] @ weight [V, H]^T / T of a loss whose gradient
    w.r.t. the logits is known from per-row quantities: the row's logsumexp lses [N, 1]
    (of z) gets grad_lse [N, 1] and the entries ids [N, K] get grad_ids [N, K], so
        G[n, v] = (grad_lse[n] softmax(z_n)[v] + sum_j [ids[n, j] == v] grad_ids[n, j]) / T,
    and grad_hidden = G @ W, grad_weight = G^T @ hidden. G is rebuilt one block of vocab
    columns at a time for all N rows, so each block of grad_weight is written once by a
    single matmul over all tokens: no [V, H] accumulation pass per chunk, and no
    float32 [V, H] buffer for low-precision weights. Returns (grad_hidden in the work
    dtype or None, grad_weight or None).
    """
    (num_tokens, _), vocab, work_dtype = hidden.shape, weight.shape[0], lses.dtype
    k = ids.shape[1]
    grad_ids, grad_lse = grad_ids / temperature, grad_lse / temperature
    # the entries, sorted by vocab id, so that each block's entries are one slice
    flat_ids = ids.flatten()
    order = flat_ids.argsort()
    sorted_ids, sorted_rows, sorted_grads = flat_ids[order], order // k, grad_ids.flatten()[order]
    # a block of [N, block] holds as many elements as a [chunk_size, V] chunk
    block = max(1, min(vocab, chunk_size * vocab // max(num_tokens, 1)))
    block_starts = list(range(0, vocab, block))
    edges = torch.searchsorted(sorted_ids, torch.tensor(block_starts + [vocab], device=sorted_ids.device)).tolist()
    new = dict(device=hidden.device)
    storage = torch.empty(num_tokens * block, dtype=work_dtype, **new)
    low_precision = hidden.dtype != work_dtype
    low_storage = torch.empty(num_tokens * block, dtype=hidden.dtype, **new) if low_precision else None
    grad_hidden = torch.zeros_like(hidden, dtype=work_dtype) if need_hidden_grad else None
    grad_weight = torch.empty_like(weight) if need_weight_grad else None
    for i, start in enumerate(block_starts):
        stop = min(start + block, vocab)
        shape = (num_tokens, stop - start)
        buffer = storage[: shape[0] * shape[1]].view(shape)
        low_buffer = None if low_storage is None else low_storage[: shape[0] * shape[1]].view(shape)
        weight_block = weight[start:stop]
        logprobs = _logits_into(buffer, hidden, weight_block, temperature, low_buffer, shift=lses)
        grad_logits = logprobs.exp_().mul_(grad_lse)
        entries = slice(edges[i], edges[i + 1])
        grad_logits.index_put_((sorted_rows[entries], sorted_ids[entries] - start), sorted_grads[entries],
                               accumulate=True)
        if low_buffer is not None:
            grad_logits = low_buffer.copy_(grad_logits)
        if grad_hidden is not None:
            if low_buffer is None:
                grad_hidden.addmm_(grad_logits, weight_block)
            else:
                grad_hidden.add_(grad_logits @ weight_block)
        if grad_weight is not None:
            torch.mm(grad_logits.T, hidden, out=grad_weight[start:stop])
    return grad_hidden, grad_weight


def _chunk_buffers(student_hidden, student_weight, chunk_size, work_dtype):
    """A reusable [chunk_size, V] logits buffer in work_dtype, plus one in the input dtype if that is lower."""
    shape = (min(chunk_size, student_hidden.shape[0]), student_weight.shape[0])
    buffer = torch.empty(shape, dtype=work_dtype, device=student_hidden.device)
    if student_hidden.dtype == work_dtype:
        return buffer, None
    return buffer, torch.empty(shape, dtype=student_hidden.dtype, device=student_hidden.device)


def sdpo_topk_loss_from_hidden(student_hidden, student_lm_head_weight, teacher_hidden, teacher_lm_head_weight=None,
                               k=100, alpha=0.5, add_tail=True, temperature=1.0, chunk_size=512, teacher_mix=0.0,
                               token_weights=None):
    """Top-K SDPO divergence computed from hidden states without materialising [N, V] logits.
    Equals, in value and gradient,

        S, T, _ = topk_with_tail(student_hidden @ W_s^T, teacher_hidden @ W_t^T, k, add_tail, temperature)
        sdpo_divergence(S, T, alpha)                                       # [N]

    student_hidden [N, H]: final hidden states at the response positions only; W_s [V, H];
    teacher_hidden [N, H] and W_t [V, H] (None = W_s); no bias term. teacher_mix = r: teacher
    logits lerp(teacher, student.detach(), r) at the same rows (the exact trust-region teacher
    is passed as concatenated hidden states and heads instead, teacher.py). The teacher side
    never gets a gradient. Logits are float32 (float64 for float64 inputs); bf16/fp16 inputs
    get bf16/fp16 matmuls.

    Returns per-token losses [N] whose backward accepts any grad_output [N] and re-runs the
    student head in blocks of vocab columns (one extra N*V*H matmul). With token_weights [N]
    (detached): the scalar sum_n token_weights[n] * loss[n], its gradients built in forward (no
    recomputation, but the [V, H] weight gradient held until backward; one backward only).
    Memory and chunk sizes: docs/loop.md, Memory.
    """
    if teacher_lm_head_weight is None:
        teacher_lm_head_weight = student_lm_head_weight
    if token_weights is not None:
        token_weights = token_weights.detach()
    return _TopKDistillFromHidden.apply(student_hidden, student_lm_head_weight, teacher_hidden.detach(),
                                        teacher_lm_head_weight.detach(), token_weights, k, alpha, add_tail,
                                        temperature, chunk_size, teacher_mix)


# -----------------------------------------------------------------------------
# token log-probs with a gradient, straight from hidden states (policy-gradient, DPO, SFT)


class _TokenLogprobsFromHidden(torch.autograd.Function):
    """Chunked token log-probs and entropies; see token_logprobs_from_hidden."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size):
        num_tokens = hidden.shape[0]
        work_dtype = torch.promote_types(hidden.dtype, torch.float32)
        buffer, low_precision_buffer = _chunk_buffers(hidden, weight, chunk_size, work_dtype)
        logprobs = torch.empty(num_tokens, dtype=work_dtype, device=hidden.device)
        entropies, lses = torch.empty_like(logprobs), torch.empty(num_tokens, 1, dtype=work_dtype, device=hidden.device)
        for start in range(0, num_tokens, chunk_size):
            rows = slice(start, min(start + chunk_size, num_tokens))
            logits = _logits_into(buffer, hidden[rows], weight, temperature, low_precision_buffer)
            picked = logits.gather(-1, targets[rows, None])
            lse, row_sum = _exp_shifted_(logits)  # logits now hold e = exp(z - max z)
            lses[rows] = lse
            logprobs[rows] = (picked - lse).squeeze(-1)
            # H = lse - sum_v p_v z_v = log S - sum_v e_v log e_v / S, with S = sum_v e_v
            entropies[rows] = (row_sum.log() - torch.special.xlogy(logits, logits).sum(-1, keepdim=True) / row_sum
                               ).squeeze(-1)
        ctx.mark_non_differentiable(entropies)
        ctx.save_for_backward(hidden, weight, targets, lses)
        ctx.config, ctx.input_dtypes = (temperature, chunk_size), (hidden.dtype, weight.dtype)
        return logprobs, entropies

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropies):
        hidden, weight, targets, lses = ctx.saved_tensors
        temperature, chunk_size = ctx.config
        grad = grad_logprobs.to(lses.dtype)[:, None]
        # d log p_t / dz = onehot(t) - softmax(z): the logsumexp gets -grad, the target +grad
        grads = _head_grads_by_vocab_blocks(hidden, weight, lses, -grad, targets[:, None], grad, temperature,
                                            chunk_size, *ctx.needs_input_grad[:2])
        return _cast_grads(*grads, ctx.input_dtypes) + (None,) * 3


def token_logprobs_from_hidden(hidden, weight, targets, temperature=1.0, chunk_size=512):
    """Token log-probs with a gradient, and entropies without, from final hidden states, never
    materialising [N, V] logits. Equals, in value and gradient,

        logits = (hidden @ weight.T).float()
        token_logprobs(logits, targets, temperature), entropy_from_logits(logits.detach(), temperature)

    hidden [N, H] (the response positions only), weight [V, H] (the LM head, no bias),
    targets [N] int64 -> (logprobs [N], entropy [N]) in float32 (float64 for float64
    inputs); bf16/fp16 inputs get bf16/fp16 matmuls. Forward keeps only each row's
    logsumexp; backward accepts any grad_output [N] and re-runs the head in blocks of vocab
    columns (one extra N*V*H matmul; docs/loop.md, Memory).
    """
    if chunk_size < 1:
        raise ValueError(f"token_logprobs_from_hidden: chunk_size must be >= 1, got {chunk_size} "
                         "(--train.head_chunk_size: 0 for the plain path, else rows per chunk)")
    return _TokenLogprobsFromHidden.apply(hidden, weight, targets, temperature, chunk_size)


@torch.no_grad()
def logprobs_and_entropy_from_hidden(hidden, weight, targets, temperature=1.0, chunk=1024):
    """Token log-probs and entropies without a gradient, from final hidden states, chunk by
    chunk so that at most [chunk, V] logits exist at once:

        logits = hidden @ weight.T;  (token_logprobs(logits, targets), entropy_from_logits(logits))

    hidden [N, H], weight [V, H], targets [N] -> ([N], [N]) float32. The forward pass of
    token_logprobs_from_hidden, without its graph: old log-probs bit-identical to the training
    pass's, so the first mini-batch's ratio is exactly 1.
    """
    logprobs, entropies = token_logprobs_from_hidden(hidden, weight, targets, temperature, chunk)
    return logprobs.float(), entropies.float()
