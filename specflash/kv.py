"""Target caches: building them, rolling them back and compacting them. The only code that
touches cache internals.

After a verification forward the cache holds entries for every fed token; only the root and the
accepted path may stay. Attention layers hold one key/value row per token: a chain keeps a prefix
(crop the tail), a tree keeps scattered rows, which are gathered into consecutive slots so the
cache again reads as sequential decoding.

Recurrent layers (linear attention such as Gated DeltaNet, short convolutions) hold one state
per sequence that every fed token has already updated, so nothing can be cropped out of it. For
those a `Checkpoint` copies the states before a forward (they are small and independent of the
context length) and `restore` puts them back; the caller then replays the tokens it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache, PretrainedConfig
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
)


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that writes each forward's keys and values into room kept behind them.

    Why: DynamicLayer concatenates, so every forward copies the whole layer; at the batch of 64
    a harvest decodes with, those copies took more time than the attention itself (57 ms of a
    120 ms step of SmolLM2-135M at 83 cached tokens, one thread), and at batch 1 they grow with
    the context. Here `keys` and `values` are views of a larger buffer, which a forward fills in
    place; crops shorten the views. Whatever replaces the views (a batch selection, a gather of
    tree rows) is copied into fresh room at the next forward, which is what concatenating cost
    every time. A forward outside inference mode on a cache filled inside it (the room then
    cannot be written) also moves to fresh room."""

    room: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if not self._backs_keys(key_states, end):
            self._regrow(key_states, value_states, start, end)
        keys, values = self.room
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values

    def _backs_keys(self, states: torch.Tensor, end: int) -> bool:
        """Whether the room still holds the current keys (nothing replaced them) and fits `end` rows."""
        if self.room is None:
            return False
        room = self.room[0]
        if room.is_inference() and not torch.is_inference_mode_enabled():
            return False  # filled in inference mode, now fed outside it: such tensors cannot be written
        return (end <= room.shape[2] and room.dtype == states.dtype and room.shape[:2] == states.shape[:2]
                and room.shape[3] == states.shape[3] and self.keys.data_ptr() == room.data_ptr()
                and self.keys.stride() == room.stride())

    def _regrow(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int, end: int) -> None:
        """Fresh room for `end` rows and half as many again, holding the current first `start`."""
        size = end + max(64, end // 2)
        rooms = []
        for old, new in ((self.keys, key_states), (self.values, value_states)):
            room = new.new_empty(*new.shape[:2], size, new.shape[3])
            if start:
                room[:, :, :start] = old
            rooms.append(room)
        self.room = (rooms[0], rooms[1])

    def reset(self) -> None:
        self.room = None
        super().reset()


def _growing_cache() -> DynamicCache:
    """An empty cache whose attention layers, created as the model fills them, are GrowingLayers."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


def new_cache(config: PretrainedConfig) -> DynamicCache:
    """A cache with the model's own recurrent layers, where it has any, and full-length attention
    layers everywhere else, sliding-window layers included: a sliding cache layer drops what
    leaves the window, so it cannot be rolled back once full (the model's masks still apply the
    window). Its plain attention layers grow in place (GrowingLayer)."""
    cache = DynamicCache(config=config)
    if not is_recurrent(cache):
        return _growing_cache()  # plain attention: layers created as the model fills them
    cache.layers = [_full_length(layer) for layer in cache.layers]
    return cache


def _full_length(layer):
    if isinstance(layer, LinearAttentionAndSlidingWindowAttentionLayer):
        return LinearAttentionAndFullAttentionLayer(layer.number_of_states)
    if type(layer) in (DynamicSlidingWindowLayer, DynamicLayer):
        return GrowingLayer()
    return layer


def is_recurrent(cache: Cache) -> bool:
    """Whether any layer keeps a recurrent (uncroppable) state."""
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


def cache_len(cache: Cache) -> int:
    return int(cache.get_seq_length())


def _attention_len(cache: Cache) -> int:
    """Entries in the attention layers; 0 for a cache of recurrent layers only (Mamba), which
    has no length to ask for."""
    return max((layer.get_seq_length() for layer in cache.layers if isinstance(layer, CacheLayerMixin)), default=0)


def _crop_attention(cache: Cache, n_tokens: int) -> None:
    """Drop the last `n_tokens` key/value rows of every attention layer; recurrent states stay."""
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            DynamicLayer.crop(layer, -n_tokens)


def rollback(cache: Cache, n_tokens: int) -> None:
    """Drop the last `n_tokens` entries of an attention-only cache (recurrent caches: restore a
    Checkpoint instead)."""
    if n_tokens <= 0:
        return
    if is_recurrent(cache):
        raise ValueError("a cache with recurrent layers cannot be cropped: restore a Checkpoint and replay")
    cache.crop(-n_tokens)


def keep_rows(cache: Cache, start: int, rows: list[int]) -> None:
    """Keep entries [0, start) plus, in order, the entries at start + rows; drop the rest.

    `rows` are offsets into the block fed at `start`. When they are 0..m-1 this is a plain crop.
    """
    total = cache_len(cache)
    if rows == list(range(len(rows))):
        rollback(cache, total - start - len(rows))
        return
    if is_recurrent(cache):
        raise ValueError("a cache with recurrent layers cannot keep scattered rows: verify chains on such targets")
    end = start + len(rows)
    with torch.inference_mode(torch.is_inference_mode_enabled() or _holds_inference_tensors(cache)):
        for layer in cache.layers:
            if not isinstance(layer, DynamicLayer) or not layer.is_initialized:
                continue
            index = torch.tensor(rows, device=layer.keys.device) + start
            # keys/values: [batch, kv_heads, seq, head_dim]; the kept rows move into place (a
            # GrowingLayer's room keeps backing them, so the next forward copies nothing)
            for name in ("keys", "values"):
                states = getattr(layer, name)
                states[:, :, start:end] = states.index_select(2, index)
                setattr(layer, name, states[:, :, :end])


def _holds_inference_tensors(cache: Cache) -> bool:
    """Whether the attention layers were filled in inference mode: their tensors can then be
    written in place only inside it (the engine's forwards run there, its bookkeeping outside)."""
    return any(isinstance(layer, DynamicLayer) and layer.is_initialized and layer.keys.is_inference()
               for layer in cache.layers)


_State = tuple[dict[int, torch.Tensor | None], dict[int, torch.Tensor | None], dict[int, bool]]


def _copy(states: dict[int, torch.Tensor | None]) -> dict[int, torch.Tensor | None]:
    return {i: None if t is None else t.clone() for i, t in states.items()}


@dataclass
class Checkpoint:
    """A cache as it was at `length` entries: copies of every recurrent layer's conv and
    recurrent states (by layer index); attention layers are cropped back to `length`."""

    length: int
    states: dict[int, _State]


@torch.inference_mode()  # the states are inference tensors; copies of them must be too
def checkpoint(cache: Cache) -> Checkpoint:
    states = {
        i: (_copy(layer.conv_states), _copy(layer.recurrent_states), dict(layer.has_previous_state))
        for i, layer in enumerate(cache.layers)
        if isinstance(layer, LinearAttentionCacheLayerMixin)
    }
    return Checkpoint(_attention_len(cache), states)


def _put(current: dict[int, torch.Tensor | None], saved: dict[int, torch.Tensor | None]) -> None:
    for i, tensor in saved.items():
        if tensor is None:
            if current[i] is not None:
                current[i].zero_()
        elif current[i] is not None and current[i].shape == tensor.shape:
            current[i].copy_(tensor)  # in place: the layer may hold a static address for graphs
        else:
            current[i] = tensor.clone()


@torch.inference_mode()
def restore(cache: Cache, saved: Checkpoint) -> None:
    """Put the cache back as it was when `saved` was taken (only forwards since then undone)."""
    _crop_attention(cache, _attention_len(cache) - saved.length)
    for i, (conv, recurrent, previous) in saved.states.items():
        layer = cache.layers[i]
        _put(layer.conv_states, conv)
        _put(layer.recurrent_states, recurrent)
        layer.has_previous_state.update(previous)


def stack_left_padded(caches: list[Cache], width: int) -> DynamicCache:
    """One batch cache from single-row attention caches of different lengths: each row's entries
    right-aligned in `width` slots, zeros before them (the batch's attention mask must hide those,
    as it hides a left-padded prompt). Lets each prompt be prefilled alone, paying for its own
    tokens instead of the batch's longest."""
    if any(is_recurrent(c) for c in caches):
        raise ValueError("recurrent states cannot be stacked from separate prefills: prefill the batch together")
    stacked = _growing_cache()
    for i in range(len(caches[0].layers)):
        rows = [(c.layers[i].keys, c.layers[i].values) for c in caches]
        first_k, first_v = rows[0]
        keys = first_k.new_zeros(len(rows), first_k.shape[1], width, first_k.shape[3])
        values = first_v.new_zeros(len(rows), first_v.shape[1], width, first_v.shape[3])
        for b, (k, v) in enumerate(rows):
            keys[b, :, width - k.shape[2]:] = k[0]
            values[b, :, width - v.shape[2]:] = v[0]
        layer = GrowingLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        stacked.layers.append(layer)
    return stacked


def select_batch_rows(cache: Cache, rows: torch.Tensor) -> None:
    """Keep only these batch rows, in every layer: key/value rows and recurrent states alike
    (transformers' own batch_select_indices knows attention layers only)."""
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer):
            layer.batch_select_indices(rows)
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for states in (layer.conv_states, layer.recurrent_states):
                for i, tensor in states.items():
                    if tensor is not None:
                        states[i] = tensor[rows]


@torch.inference_mode()
def recurrent_rows(cache: Cache, rows: torch.Tensor) -> dict[int, tuple[dict, dict]]:
    """Copies of these batch rows' recurrent states (by layer index), for put_recurrent_rows."""
    return {  # indexing by a tensor of rows copies
        i: tuple({k: None if t is None else t[rows] for k, t in states.items()}
                 for states in (layer.conv_states, layer.recurrent_states))
        for i, layer in enumerate(cache.layers)
        if isinstance(layer, LinearAttentionCacheLayerMixin)
    }


@torch.inference_mode()
def put_recurrent_rows(cache: Cache, rows: torch.Tensor, copies: dict) -> None:
    """Write states copied by recurrent_rows back into these batch rows."""
    for i, (conv, recurrent) in copies.items():
        layer = cache.layers[i]
        for current, saved in ((layer.conv_states, conv), (layer.recurrent_states, recurrent)):
            for k, tensor in saved.items():
                if tensor is not None:
                    current[k][rows] = tensor
