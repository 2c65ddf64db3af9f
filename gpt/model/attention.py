"""The attention op and the two fixed position encodings (sinusoidal and rotary).

Shape letters: B batch, T query positions, S key positions, N heads, H head dim, D model width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gpt.model import cpu_kernels
from gpt.model.backend import choices
from gpt.model.splash import splash_causal, splash_fits

__all__ = ["attend", "causal_band", "seen_slots", "attend_paged", "kernel_attend_paged", "sinusoidal_embedding",
           "rope_frequencies", "apply_rope",
           "MAX_KERNEL_HEAD_DIM"]

MAX_KERNEL_HEAD_DIM = 128  # `kernel_attend_paged` keeps a head in registers; larger ones are XLA's


def sinusoidal_embedding(positions_BT: jax.Array, width: int) -> jax.Array:
    """The fixed table of "Attention is all you need": sin on even channels, cos on odd ones.

    Args:
      positions_BT: int32 positions, [B, T].
      width: the embedding width D (even).
    Returns:
      float32 [B, T, D].
    """
    inverse_freq = 1.0 / (10000.0 ** (jnp.arange(0, width, 2, dtype=jnp.float32) / width))
    angles_BTK = positions_BT.astype(jnp.float32)[..., None] * inverse_freq
    # Interleave so that channel 2i is sin and 2i+1 is cos of the same frequency.
    return jnp.stack([jnp.sin(angles_BTK), jnp.cos(angles_BTK)], axis=-1).reshape(*positions_BT.shape, width)


def rope_frequencies(head_dim: int, theta: float, scaling: float = 1.0, low: float = 1.0, high: float = 4.0,
                     context: int = 8192) -> np.ndarray:
    """The rotary angle per position of each channel pair, float32 [head_dim / 2]: theta^(-i / (head_dim / 2)),
    then Llama 3's scaling: pairs whose wavelength exceeds context / low turn `scaling` times slower, those
    under context / high as they were, those between by a blend (`scaling` 1 changes nothing)."""
    half = head_dim // 2
    inverse = (1.0 / theta ** (np.arange(half, dtype=np.float32) / half)).astype(np.float32)
    wavelength = 2 * np.pi / inverse
    slow = np.where(wavelength > context / low, inverse / scaling, inverse)
    blend = (context / wavelength - low) / (high - low)
    between = (wavelength >= context / high) & (wavelength <= context / low)
    return np.where(between, (1 - blend) * slow / scaling + blend * slow, slow).astype(np.float32)


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, inverse_freq: np.ndarray) -> jax.Array:
    """Rotary position embedding, rotating the two halves of each head as pairs (GPT-NeoX layout).

    Args:
      x_BTNH: queries or keys, [B, T, N, H] with H even.
      positions_BT: int32 positions, [B, T]; rows may differ (ragged batches).
      inverse_freq: float32 [H / 2], each pair's angle per position (`rope_frequencies`).
    Returns:
      [B, T, N, H] in x's dtype; the rotation itself is computed in float32.
    """
    angles_BTK = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inverse_freq, jnp.float32)
    cos_BT1K = jnp.cos(angles_BTK)[:, :, None, :]
    sin_BT1K = jnp.sin(angles_BTK)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos_BT1K - x2 * sin_BT1K, x2 * cos_BT1K + x1 * sin_BT1K], axis=-1)
    return rotated.astype(x_BTNH.dtype)


def causal_band(T: int, window: int | jax.Array) -> jax.Array:
    """bool [T, T]: query t sees key s for t - window < s <= t (a local layer's causal mask; `window` may be
    traced: a scan over layers of several kinds)."""
    offset_TT = jnp.arange(T, dtype=jnp.int32)[:, None] - jnp.arange(T, dtype=jnp.int32)[None, :]
    return (offset_TT >= 0) & (offset_TT < window)


def attend(q_BTNH: jax.Array, k_MSH: jax.Array, v_MSH: jax.Array, mask_BTS: jax.Array | None,
           window: int | jax.Array | None = None) -> jax.Array:
    """Scaled dot-product attention, grouped-query where the keys and values have fewer heads than the queries.

    Which form runs is the backend's `attention` choice (`gpt.model.backend`). On GPUs it is
    `jax.nn.dot_product_attention`: cuDNN's fused (flash) kernel where it takes the call (`fused_causal`),
    XLA's otherwise. On TPUs, causal attention without a mask (a local layer's band of a Python int included) is
    Pallas' splash kernel where its blocks and the mesh divide the shapes (`gpt.model.splash`). Elsewhere it is the plain softmax(q k^T / sqrt(H)) v over
    rows x key heads as one batch axis, each key head's G query heads as one longer run of queries, which XLA
    on CPU runs about 1.7x faster (forward + backward) than the fallback inside `jax.nn.dot_product_attention`.

    Args:
      q_BTNH: queries [B, T, N, H]; query head n reads key head n // G, G = N / K (Llama's grouping).
      k_MSH, v_MSH: keys and values [B * K, S, H], rows major (the KV cache's layout: one 3-D buffer,
        so that a batch of 1 adds no degenerate axis for XLA to reshape the cache around); K divides N.
      mask_BTS: bool [B, T, S], True where a query may see a key; None means plainly causal with T == S.
        Every query must see at least one key.
      window: with no mask, a local layer's: query t sees keys t - window + 1..t (`causal_band`); None: 0..t.
    Returns:
      [B, T, N, H] in q's dtype; the softmax is computed in float32.
    """
    B, T, N, H = q_BTNH.shape
    S, K = k_MSH.shape[1], k_MSH.shape[0] // B
    G = N // K
    kind = choices().attention
    to_BSKH = lambda x: x.reshape(B, K, S, H).transpose(0, 2, 1, 3)  # noqa: E731
    kernel_window = window is None or isinstance(window, int)  # a fused kernel takes a Python int's band
    if kind == "splash" and mask_BTS is None and kernel_window and splash_fits(B, T, N):
        every_head = lambda x: jnp.repeat(to_BSKH(x), G, axis=2)  # noqa: E731  (its kernel takes N key heads)
        return splash_causal(q_BTNH, every_head(k_MSH), every_head(v_MSH), window)
    if mask_BTS is None and window is not None and not (kind == "dot_product" and kernel_window):
        mask_BTS = jnp.broadcast_to(causal_band(T, window), (B, T, S))  # a traced window: a mask like any other
    if kind == "dot_product":
        k_BSKH, v_BSKH = to_BSKH(k_MSH), to_BSKH(v_MSH)
        if mask_BTS is None:
            return fused_causal(q_BTNH, k_BSKH, v_BSKH, window)
        return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None, :, :])
    # Rows x key heads as one batch axis M, and each key head's G query heads one after another (G * T queries).
    q_MQH = (q_BTNH * jnp.asarray(H ** -0.5, q_BTNH.dtype)).reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)
    q_MQH = q_MQH.reshape(B * K, G * T, H)
    # Contract H of both directly: `q @ k.swapaxes(-1, -2)` makes XLA on CPU copy a transposed k.
    scores_MQS = jnp.einsum("MQH,MSH->MQS", q_MQH, k_MSH, preferred_element_type=jnp.float32)
    mask_MQS = (jnp.tile(jnp.tril(jnp.ones((1, T, S), jnp.bool_)), (1, G, 1)) if mask_BTS is None
                else jnp.broadcast_to(mask_BTS[:, None, None], (B, K, G, T, S)).reshape(B * K, G * T, S))
    scores_MQS = jnp.where(mask_MQS, scores_MQS, jnp.finfo(jnp.float32).min)
    # softmax; the max is a constant for the gradient (the result does not depend on it)
    exp_MQS = jnp.exp(scores_MQS - jax.lax.stop_gradient(scores_MQS.max(-1, keepdims=True)))
    weights_MQS = (exp_MQS / exp_MQS.sum(-1, keepdims=True)).astype(v_MSH.dtype)
    out_MQH = jnp.einsum("MQS,MSH->MQH", weights_MQS, v_MSH)
    return out_MQH.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


def fused_causal(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, window: int | None = None) -> jax.Array:
    """Causal attention [B, T, N, H] of keys and values of K heads (each query seeing the last `window` keys,
    its own included, where a window is given) through cuDNN's flash kernel where it takes the call, else XLA's.

    `jax.nn.dot_product_attention` runs XLA's attention (the T x T scores written out) unless cuDNN is
    asked for by name; cuDNN takes 16-bit operands on the GPUs it supports, and says so at trace time
    otherwise (float32, an older GPU, a head size it lacks), when XLA's computes the same function.
    """
    local = {} if window is None else {"local_window_size": (window - 1, 0)}
    if q_BTNH.dtype in (jnp.bfloat16, jnp.float16):
        try:
            return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True, implementation="cudnn",
                                                **local)
        except (RuntimeError, ValueError, NotImplementedError):
            pass
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True, implementation="xla", **local)


def attend_paged(q_B1NH: jax.Array, k_pages: tuple[jax.Array, ...], v_pages: tuple[jax.Array, ...],
                 positions_B1: jax.Array, rows_M: jax.Array | None = None, window: int | None = None,
                 ring: int | None = None) -> jax.Array:
    """One query per row over a paged KV cache (`gpt.model.kv_cache`), reading only the pages the rows have
    reached.

    A decode step's cost is streaming the weights and the cache; a cache sized for the model's whole
    context but holding short sequences would be read in full by plain attention. Page 0 is always read;
    each later page only when the furthest row has reached it (a traced condition: one compiled program
    for any lengths). Each page gives its own part of the softmax (max, sum, weighted values), and the
    parts are combined at the end, as flash-decoding does. Each page is its own buffer, read in place:
    XLA on CPU would copy a slice of one larger buffer before the dot. A cache of one page is read whole
    under the mask (`attend`: cuDNN's kernel on a GPU). On a CPU where the compiled kernels run
    (`gpt.model.cpu_kernels`), a float32 cache is read by one of them instead (`kernel_attend_paged`).

    Args:
      q_B1NH: queries [B, 1, N, H]; query head n reads key head n // (N / K).
      k_pages, v_pages: the cache's keys and values, pages of [B * K, P, H] covering slots 0, 1, ...
        (of [R * K, P, H], R >= B, with rows_M).
      positions_B1: int32 [B, 1], each row's query position; it sees cache slots 0..position.
      rows_M: int32 [B * K], the page row of each query row's key heads (a view of some of the cache's rows,
        `KVCache.select`); None when they are rows 0..B*K-1. Only the pages read are gathered.
      window: a local layer's: each row sees positions position - window + 1..position; None: 0..position.
      ring: a local layer's ring of that many slots in one page (position p in slot p mod ring); None: slot s
        holds position s.
    Returns:
      [B, 1, N, H] in q's dtype; the softmax is computed in float32.
    """
    B, _, N, H = q_B1NH.shape
    if q_B1NH.dtype == k_pages[0].dtype == jnp.float32 and H <= MAX_KERNEL_HEAD_DIM and cpu_kernels.isa() is not None:
        return kernel_attend_paged(q_B1NH, k_pages, v_pages, positions_B1, rows_M, window, ring)
    take = (lambda page: page) if rows_M is None else (lambda page: page[rows_M])  # noqa: E731
    if len(k_pages) == 1:
        S = k_pages[0].shape[1]
        return attend(q_B1NH, take(k_pages[0]), take(v_pages[0]),
                      seen_slots(jnp.arange(S), positions_B1, window, ring))
    assert ring is None, "a ring is one page"
    return _attend_pages(q_B1NH, k_pages, v_pages, positions_B1, rows_M, take, window)


def seen_slots(slots_S: jax.Array, positions_BT: jax.Array, window: int | None, ring: int | None = None) -> jax.Array:
    """bool [B, T, S]: which of cache slots `slots_S` [S] each query at `positions_BT` [B, T] sees: those holding a
    position at or before its own (and not before 0), and within `window` of it where one is given. Slot s holds
    position s, or in a `ring` of that many slots, for a query at p, p - ((p - s) mod ring) (`gpt.model.kv_cache`:
    where it holds another, that one is outside the window)."""
    back_BTS = positions_BT[:, :, None] - slots_S[None, None, :]  # how far before the query the slot's position is
    back_BTS = back_BTS if ring is None else back_BTS % ring
    seen_BTS = (back_BTS >= 0) & (back_BTS <= positions_BT[:, :, None])
    return seen_BTS if window is None else seen_BTS & (back_BTS < window)


def _attend_pages(q_B1NH: jax.Array, k_pages: tuple[jax.Array, ...], v_pages: tuple[jax.Array, ...],
                  positions_B1: jax.Array, rows_M: jax.Array | None, take, window: int | None) -> jax.Array:
    """`attend_paged` over several pages in XLA's ops, flash-decoding's way: each page read gives its part of
    the softmax, combined at the end; `take` gathers a page's rows of the view. [B, 1, N, H]."""
    B, _, N, H = q_B1NH.shape
    K = key_heads(B, k_pages[0], rows_M)
    M, G = B * K, N // K
    q_MGH = (q_B1NH[:, 0] * jnp.asarray(H ** -0.5, q_B1NH.dtype)).reshape(M, G, H)
    position_M1 = jnp.repeat(positions_B1, K, axis=0)  # row b's position for each of its K key heads
    furthest = jnp.max(positions_B1)

    def page_partial(start, k_MPH, v_MPH):
        """This page's part of the softmax: its max score, the sum of exp(score - max), and the
        exp-weighted sum of its values (all zero where a row sees none of the page), per query [M, G]."""
        k_MPH, v_MPH = take(k_MPH), take(v_MPH)
        seen_M1P = seen_slots(start + jnp.arange(k_MPH.shape[1]), position_M1, window)
        scores_MGP = jnp.einsum("MGH,MPH->MGP", q_MGH, k_MPH, preferred_element_type=jnp.float32)
        scores_MGP = jnp.where(seen_M1P, scores_MGP, -jnp.inf)
        max_MG = scores_MGP.max(-1)
        weights_MGP = jnp.exp(scores_MGP - jnp.where(jnp.isfinite(max_MG), max_MG, 0.0)[..., None])
        acc_MGH = jnp.einsum("MGP,MPH->MGH", weights_MGP.astype(v_MPH.dtype), v_MPH,
                             preferred_element_type=jnp.float32)
        return max_MG, weights_MGP.sum(-1), acc_MGH

    def unseen(k_MPH, v_MPH):
        return jnp.full((M, G), -jnp.inf), jnp.zeros((M, G)), jnp.zeros((M, G, H))

    # The pages' parts are independent of one another, so XLA may run them at once on different cores.
    # Page 0 is always read (slot 0 is always seen).
    parts, start = [], 0
    for page, (k_MPH, v_MPH) in enumerate(zip(k_pages, v_pages)):
        read = functools.partial(page_partial, start)
        parts.append(read(k_MPH, v_MPH) if page == 0 else jax.lax.cond(start <= furthest, read, unseen, k_MPH, v_MPH))
        start += k_MPH.shape[1]
    return _combine_pages(parts).astype(q_B1NH.dtype).reshape(B, 1, N, H)


def key_heads(batch: int, page: jax.Array, rows_M: jax.Array | None) -> int:
    """K, the key heads of a cache's page [B * K, P, H] (or of its view's rows_M [B * K]) for `batch` rows."""
    return (page.shape[0] if rows_M is None else rows_M.shape[0]) // batch


def _combine_pages(parts: list[tuple[jax.Array, jax.Array, jax.Array]]) -> jax.Array:
    """The softmax-weighted values [M, G, H] from each page's part (its max score [M, G], sum of
    exp(score - max) [M, G] and exp-weighted values [M, G, H]), as flash-decoding combines them."""
    max_PMG = jnp.stack([p[0] for p in parts])
    max_MG = max_PMG.max(0)
    rescale_PMG = jnp.exp(max_PMG - max_MG)  # exp(-inf) = 0 for pages no row has reached
    sum_MG = (rescale_PMG * jnp.stack([p[1] for p in parts])).sum(0)
    acc_MGH = (rescale_PMG[..., None] * jnp.stack([p[2] for p in parts])).sum(0)
    return acc_MGH / sum_MG[..., None]


def kernel_attend_paged(q_B1NH: jax.Array, k_pages: tuple[jax.Array, ...], v_pages: tuple[jax.Array, ...],
                        positions_B1: jax.Array, rows_M: jax.Array | None = None,
                        window: int | None = None, ring: int | None = None) -> jax.Array:
    """`attend_paged` (the same arguments, float32) in one compiled call (`gpt.model.kernels.decode_attention`):
    each query reads the slots of the positions it sees, and no more, where XLA ran about 25 small programs a
    layer. Each of a key head's G query heads reads its row on its own. Only where `cpu_kernels.isa()` is not
    None, for H <= MAX_KERNEL_HEAD_DIM. Returns [B, 1, N, H] float32."""
    B, _, N, H = q_B1NH.shape
    K = key_heads(B, k_pages[0], rows_M)
    rows_M = jnp.arange(B * K, dtype=jnp.int32) if rows_M is None else rows_M.astype(jnp.int32)
    rows_Q = jnp.repeat(rows_M, N // K)  # each query head's key row
    position_Q = jnp.repeat(positions_B1[:, 0].astype(jnp.int32), N)  # row b's position for each of its heads
    out_QH = cpu_kernels.call("gpt_decode_attention", jax.ShapeDtypeStruct((B * N, H), jnp.float32))(
        q_B1NH.reshape(B * N, H), position_Q, rows_Q, *k_pages, *v_pages, window=np.int64(window or 0),
        ring=np.int64(ring or 0))
    return out_QH.reshape(B, 1, N, H)
