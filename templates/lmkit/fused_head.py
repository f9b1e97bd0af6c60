"""A tied LM head's softmax cross-entropy as two Pallas TPU kernels: the [tokens, vocab] logits never reach HBM.

What GPT-2's loss is on a TPU (layers.use_tpu_kernels), and BERT's under a remat policy, with its output bias on
the logits (layers.TiedHeadTrainer). The logits hidden @ embeddings^T of a [tokens, vocab] head are gpt2-small's
largest tensor by far (1.6 GB in float32 per device at batch 8), and BERT's [B, predictions, vocab] ones cost it up to
5% of its step's bytes. Under XLA every pass over them (the matmul's output, the softmax's reductions, the
backward's recompute and gradient) is a round trip through HBM: the blocked XLA head this replaced (a block of
positions at a time, each recomputed for the backward) kept them from existing whole, not from being written and
read. Here each [token block, vocab block] tile of logits lives in the TensorCore's on-chip
memory (VMEM) only, as splash attention does for attention scores:

- forward, one pass over the vocabulary per token block (the vocabulary axis innermost): an online log-sum-exp
  (running max and sum, as flash attention's softmax), the label's logit, the first argmax (for the accuracy),
  and, in the same pass, sum_j softmax_j * embeddings_j, the expected output embedding, accumulated with the
  same rescaling flash attention applies to its P @ V. The hidden states' gradient is then
  upstream * (that - embeddings[label]): no second pass over the vocabulary for it.
- backward, one pass over the tokens per vocabulary block: each tile's logits recomputed, softmax - one_hot
  scaled by the upstream gradient, and its product with the hidden states accumulated into the embeddings'
  gradient in float32 (a frequent label sums thousands of tokens); with a bias, its row sums into the bias's.

The matmuls are as many as the blocked XLA head's (forward, its recompute, and the two gradients); what goes
is HBM traffic: the hidden states are read once per vocabulary block and the embeddings once per token block,
instead of [tokens, vocab] tensors several times. Each kernel declares its FLOPs and bytes by that arithmetic
(`pl.CostEstimate`): a Pallas kernel without one is invisible to the compiler's cost analysis, which `tpuctl
fit` and bench/tpu_compile.py read. Precision as layers.tied_softmax_cross_entropy: matmuls in the compute dtype
(bfloat16 under mixed precision) accumulated in float32, the softmax in float32.

`interpret=True` runs the kernels in Pallas' interpreter (tests, on a CPU). JAX only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes (tokens and vocabulary rows a tile) of the forward pass and the embeddings' gradient, and the
    VMEM the kernels may use (vmem_limit_bytes; None: Mosaic's default)."""
    tokens: int = 512
    vocab: int = 512
    grad_tokens: int = 512
    grad_vocab: int = 512
    vmem_limit: int | None = None


def tiles_for(tokens: int, width: int, vmem_bytes: int | None) -> Tiles:
    """The largest tiles (powers of two, no more than `tokens` needs) whose buffers fit in half of a TensorCore's
    `vmem_bytes` (None: not a TPU: the defaults) for `tokens` hidden states `width` wide; the kernels may then use
    three quarters of it. The gradient's vocabulary tile stops at 2048 rows: the last tile runs past the
    vocabulary's end (GPT-2's 50257 rows take 25 tiles, 51200 rows), and those rows cost FLOPs. A larger token
    tile reads the embeddings fewer times, a larger vocabulary tile the hidden states: the HBM traffic.
    VMEM per token of the forward's tile: the [tokens, width] hidden block (bfloat16) and expected-embedding
    output (float32), double-buffered, and its float32 accumulator (16 x width), [tokens, 1] columns padded to
    128 lanes of 4 bytes (~12 of them), and a [tokens, vocab] float32 tile of logits with its bfloat16 copy. Per
    vocabulary row of the gradient's tile: its float32 output and bfloat16 embeddings, double-buffered (12 x
    width), and its [vocab, tokens] logits and gradient (6 x tokens)."""
    if vmem_bytes is None:
        return Tiles()
    budget = vmem_bytes // 2
    vocab = grad_tokens = 512

    def largest(per_unit: int, fixed: int, most: int) -> int:
        n = 128
        while n < most and 2 * n * per_unit + fixed <= budget:
            n *= 2
        return n

    most_tokens = max(128, 1 << (tokens - 1).bit_length())
    return Tiles(tokens=largest(16 * width + 12 * 512 + 6 * vocab, 4 * vocab * width, most_tokens), vocab=vocab,
                 grad_tokens=min(grad_tokens, most_tokens),
                 grad_vocab=largest(12 * width + 6 * grad_tokens, 4 * grad_tokens * width, 2048),
                 vmem_limit=vmem_bytes * 3 // 4)


# The bias and its gradient in the embeddings' kernel, whose logits are [vocab, tokens]: a [vocab, 1] array is a
# [vocab, 128] one in HBM (a TPU lays out 128 lanes), 15 MB each for BERT's vocabulary; 8 rows [8, vocab] are 1 MB.
ROWS = 8


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _forward_kernel(labels_ref, hidden_ref, kernel_ref, *refs, vocab: int, bias: bool):
    bias_ref, *refs = refs if bias else (None, *refs)
    lse_ref, picked_ref, best_ref, expected_ref, top, total, picked, best, acc = refs
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        top[...] = jnp.full(top.shape, -jnp.inf, jnp.float32)
        total[...] = jnp.zeros(total.shape, jnp.float32)
        picked[...] = jnp.zeros(picked.shape, jnp.float32)
        best[...] = jnp.zeros(best.shape, jnp.float32)
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    # The vocabulary's last tile runs past its end (the embeddings are not padded: a padded copy would be one
    # more [V, h] buffer in HBM): those rows hold whatever the buffer holds, so they are zeroed, and masked below.
    rows = j * kernel_ref.shape[0] + jax.lax.broadcasted_iota(jnp.int32, (kernel_ref.shape[0], 1), 0)
    kernel = jnp.where(rows < vocab, kernel_ref[...], 0)
    logits = jax.lax.dot_general(hidden_ref[...], kernel, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [tokens, vocab] of the tile
    if bias:  # [1, vocab] of the tile; past the vocabulary's end whatever the buffer holds, masked below
        logits = logits + bias_ref[...]
    # Column indices in float32 (exact below 2**24): float reductions lower on every TPU generation.
    column = (j * logits.shape[1] + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)).astype(jnp.float32)
    logits = jnp.where(column < vocab, logits, -jnp.inf)
    block_top = jnp.max(logits, axis=1, keepdims=True)
    block_best = jnp.min(jnp.where(logits == block_top, column, jnp.inf), axis=1, keepdims=True)
    new_top = jnp.maximum(top[...], block_top)
    best[...] = jnp.where(block_top > top[...], block_best, best[...])  # strictly: the first index wins a tie
    rescale = jnp.exp(top[...] - new_top)
    p = jnp.exp(logits - new_top)
    total[...] = rescale * total[...] + jnp.sum(p, axis=1, keepdims=True)
    acc[...] = rescale * acc[...] + jnp.dot(p.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
    picked[...] += jnp.sum(jnp.where(column == labels_ref[...], logits, 0.0), axis=1, keepdims=True)
    top[...] = new_top

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        lse_ref[...] = top[...] + jnp.log(total[...])
        picked_ref[...] = picked[...]
        best_ref[...] = best[...]
        expected_ref[...] = acc[...] / total[...]


def _embeddings_grad_kernel(labels_ref, lse_ref, upstream_ref, hidden_ref, kernel_ref, *refs, bias: bool):
    bias_ref, grad_ref, bias_grad_ref = refs if bias else (None, *refs, None)
    i = pl.program_id(1)

    @pl.when(i == 0)
    def _():
        grad_ref[...] = jnp.zeros(grad_ref.shape, jnp.float32)
        if bias:
            bias_grad_ref[...] = jnp.zeros(bias_grad_ref.shape, jnp.float32)

    hidden = hidden_ref[...]
    # The tile transposed, [vocab, tokens]: the per-token values are rows [1, tokens] broadcast down it, and the
    # gradient's matmul is a plain [vocab, tokens] @ [tokens, h]. Each gradient row is its embedding row's alone:
    # the rows past the vocabulary's end (the last tile's) compute garbage that Pallas does not write back.
    logits = jax.lax.dot_general(kernel_ref[...], hidden, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    if bias:  # the tile's [8, vocab] rows (ROWS), as a [vocab, 1] column: the logits are transposed here
        logits = logits + bias_ref[...].T[:, :1]
    row = (pl.program_id(0) * logits.shape[0] + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 0)).astype(jnp.float32)
    softmax = jnp.exp(logits - lse_ref[...])
    d_logits = (softmax - jnp.where(row == labels_ref[...], 1.0, 0.0)) * upstream_ref[...]
    grad_ref[...] += jnp.dot(d_logits.astype(hidden.dtype), hidden, preferred_element_type=jnp.float32)
    if bias:  # the rows' sums, as [8, vocab] rows (a matmul by ones: no [vocab, 1] column in HBM)
        bias_grad_ref[...] += jax.lax.dot_general(jnp.ones((ROWS, d_logits.shape[1]), jnp.float32), d_logits,
                                                  (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _padded(labels, hidden, embeddings, tiles: Tiles):
    """`labels` [T] as float32, `hidden` [T, h] padded to whole token tiles (zeros, label 0, no gradient), and
    `embeddings` [V, h] in hidden's dtype."""
    tokens = hidden.shape[0]
    t_pad = _round_up(tokens, max(tiles.tokens, tiles.grad_tokens))
    return (jnp.pad(labels.astype(jnp.float32), (0, t_pad - tokens)),
            jnp.pad(hidden, ((0, t_pad - tokens), (0, 0))), embeddings.astype(hidden.dtype))


def _forward(labels, hidden, kernel, bias, vocab: int, tiles: Tiles, interpret: bool):
    """(lse, label logit, first argmax [T] float32 each, expected embedding [T, h] float32) for _padded's, with
    `bias` [V] float32 on the logits (None: none)."""
    (tokens, width), tm, tv, item = hidden.shape, tiles.tokens, tiles.vocab, hidden.dtype.itemsize
    v_pad = _round_up(vocab, tv)  # what the tiles cover
    with_bias = bias is not None
    cost = pl.CostEstimate(
        flops=4 * tokens * v_pad * width + (9 if with_bias else 8) * tokens * v_pad, transcendentals=tokens * v_pad,
        bytes_accessed=(tokens * width * item + (tokens // tm) * v_pad * (width * item + 4 * with_bias)  # per
                        + tokens * width * 4 + tokens * 4 * 4))  # token tile: the embeddings (and the bias)
    column = pl.BlockSpec((tm, 1), lambda i, j: (i, 0))
    vocab_tile = [pl.BlockSpec((1, tv), lambda i, j: (0, j))] if with_bias else []
    lse, picked, best, expected = pl.pallas_call(
        functools.partial(_forward_kernel, vocab=vocab, bias=with_bias),
        grid=(tokens // tm, v_pad // tv),  # vocabulary innermost: the token tile's accumulators stay in VMEM
        in_specs=[column, pl.BlockSpec((tm, width), lambda i, j: (i, 0)),
                  pl.BlockSpec((tv, width), lambda i, j: (j, 0)), *vocab_tile],
        out_specs=[column, column, column, pl.BlockSpec((tm, width), lambda i, j: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((tokens, 1), jnp.float32)] * 3
        + [jax.ShapeDtypeStruct((tokens, width), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((tm, 1), jnp.float32)] * 4 + [pltpu.VMEM((tm, width), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=tiles.vmem_limit),
        cost_estimate=cost, interpret=interpret,
    )(labels[:, None], hidden, kernel, *([bias[None, :]] if with_bias else []))
    return lse[:, 0], picked[:, 0], best[:, 0], expected


def _embeddings_grad(labels, lse, upstream, hidden, kernel, bias, tiles: Tiles, interpret: bool):
    """(d loss / d embeddings [V, h] float32, d loss / d bias [V] float32 or None without `bias`) for per-token
    `upstream` [T] gradients (_padded's inputs)."""
    (tokens, width), vocab = hidden.shape, kernel.shape[0]
    tm, tv, item = tiles.grad_tokens, tiles.grad_vocab, hidden.dtype.itemsize
    v_pad = _round_up(vocab, tv)
    with_bias = bias is not None
    cost = pl.CostEstimate(
        flops=4 * tokens * v_pad * width + (8 if with_bias else 6) * tokens * v_pad, transcendentals=tokens * v_pad,
        bytes_accessed=(v_pad * width * item + (v_pad // tv) * tokens * (width * item + 12)  # hidden per vocab tile
                        + v_pad * width * 4 + 8 * ROWS * v_pad * with_bias))
    per_token = pl.BlockSpec((1, tm), lambda j, i: (0, i))
    vocab_rows = pl.BlockSpec((ROWS, tv), lambda j, i: (0, j))
    grads = pl.pallas_call(
        functools.partial(_embeddings_grad_kernel, bias=with_bias),
        grid=(v_pad // tv, tokens // tm),  # tokens innermost: the vocabulary tile's gradient stays in VMEM
        in_specs=[per_token, per_token, per_token, pl.BlockSpec((tm, width), lambda j, i: (i, 0)),
                  pl.BlockSpec((tv, width), lambda j, i: (j, 0)), *([vocab_rows] if with_bias else [])],
        out_specs=[pl.BlockSpec((tv, width), lambda j, i: (j, 0)), *([vocab_rows] if with_bias else [])],
        out_shape=[jax.ShapeDtypeStruct((vocab, width), jnp.float32),
                   *([jax.ShapeDtypeStruct((ROWS, vocab), jnp.float32)] if with_bias else [])],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=tiles.vmem_limit),
        cost_estimate=cost, interpret=interpret,
    )(labels[None, :], lse[None, :], upstream[None, :], hidden, kernel,
      *([jnp.broadcast_to(bias, (ROWS, vocab))] if with_bias else []))
    return grads[0], grads[1][0] if with_bias else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def fused_softmax_cross_entropy(labels, hidden, embeddings, bias, tiles: Tiles, interpret: bool,
                                early_gradients: bool):
    """(-log softmax(logits)[label] float32, 1.0 where the label is the first argmax else 0.0) per token, for int
    `labels` [T], `hidden` [T, h] (the compute dtype), a tied head's `embeddings` [V, h] and its output `bias` [V]
    or None: logits = hidden @ embeddings^T in hidden's dtype (+ bias in float32), never written to HBM.
    Differentiable in `hidden`, `embeddings` and `bias` (the accuracy carries no gradient). `tiles`: tiles_for's;
    `interpret`: run in Pallas' interpreter (a CPU); `early_gradients`: the three gradients computed before any is
    used, as lmkit's `projection` under remat (left to itself, libtpu runs the embeddings' gradient near the
    optimizer and keeps the head's inputs in HBM through the backward pass; without remat that costs HBM)."""
    return _fused_forward(labels, hidden, embeddings, bias, tiles, interpret, early_gradients)[0]


def _fused_forward(labels, hidden, embeddings, bias, tiles, interpret, early_gradients):
    tokens = hidden.shape[0]
    padded = _padded(labels, hidden, embeddings, tiles)
    bias_f32 = None if bias is None else bias.astype(jnp.float32)
    lse, picked, best, expected = _forward(*padded, bias_f32, embeddings.shape[0], tiles, interpret)
    outputs = (lse - picked)[:tokens], (best == padded[0]).astype(jnp.float32)[:tokens]
    return outputs, (padded, lse, expected[:tokens], labels, embeddings, bias, bias_f32)


def _fused_backward(tiles, interpret, early_gradients, residuals, upstream):
    (labels_f, hidden, kernel), lse, expected, labels, embeddings, bias, bias_f32 = residuals
    d_loss = upstream[0].astype(jnp.float32)
    tokens = d_loss.shape[0]
    d_hidden = d_loss[:, None] * (expected - jnp.take(kernel, labels, axis=0).astype(jnp.float32))
    d_padded = jnp.pad(d_loss, (0, hidden.shape[0] - tokens))  # padded tokens carry no gradient
    d_embeddings, d_bias = _embeddings_grad(labels_f, lse, d_padded, hidden, kernel, bias_f32, tiles, interpret)
    grads = (d_hidden.astype(hidden.dtype), d_embeddings.astype(embeddings.dtype),
             None if bias is None else d_bias.astype(bias.dtype))
    d_hidden, d_embeddings, d_bias = jax.lax.optimization_barrier(grads) if early_gradients else grads
    return jnp.zeros(labels.shape, jax.dtypes.float0), d_hidden, d_embeddings, d_bias


fused_softmax_cross_entropy.defvjp(_fused_forward, _fused_backward)
