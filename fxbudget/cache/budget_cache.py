"""`BudgetCache`: fixed-size KV slots per layer.

Every tensor is allocated up front and only written in place, so a compiled graph sees the cache as graph inputs and
never changes shape. `update()` does not attend or evict: it emits the marker op `fxbudget::candidates`
(`fxbudget.kernel.marker`), whose arguments are everything the kernel needs; the SDPA pass (compiled path) or the eager
interceptor (eager path) replaces the SDPA call fed by it with `budget_attention`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from ..checks import check_int, check_slot_dtype
from ..passes.eager import require_interceptor
from ..kernel.signals import TOKEN_SIGNALS, out_projection_factors, unknown_wo
from ..kernel.slot_storage import slot_shape
from ..kernel.state import SLOT_FIELDS, TOTALED, LayerConstants, LayerSlots, NewTokens, marker_tensors
from ..models.architectures import layer_shapes
from ..models.layer_config import layer_inv_freq, layer_windows, text_config
from ..kernel.marker import MarkerCall  # importing it also registers the marker op `fxbudget::candidates`
from . import speculative


# Every tensor of a layer's state: what a call writes in place, and so what saving, restoring, branching and resetting
# a layer read (`BudgetLayer.snapshot`, `load`, `reset`). A tensor added to the layer is added here, once.
LAYER_STATE = SLOT_FIELDS + ("seen",)  # the kernel's `LayerSlots`, and the count of tokens seen
# What the kernel reads but never writes (set when the cache is built or the model attached).
LAYER_CONSTANTS = ("inv_freq", "wo")


@dataclass
class CallPositions:
    """What `BudgetForward` knows of the call about to run, shared by every layer of a cache: the positions of its
    tokens per row (`[batch, n]`, -1 = a pad: left padding of a batch, or fxbudget's own padding to a shape bucket)
    and how many tokens the call adds to `get_seq_length()` (pads of the user's batch count, fxbudget's do not).
    Unset (None), a layer numbers the call's tokens on from `seen` (a plain `torch.compile(backend="fxbudget")`).
    `empty`: a one-call prefill on a cache that held no token (`BudgetCache.empty`): no slot is valid; False when
    unknown or chunked."""

    pos: Tensor | None = None
    advance: Tensor | None = None
    empty: bool = False


class BudgetLayer(CacheLayerMixin):
    """One layer's slots: keys/values `[batch, kv_heads, slots, head_dim]`, positions (-1 = empty), accumulated
    attention, and each slot's owner (the KV head whose entry it holds). `slots = budget + headroom` for budgeted
    layers, `= sliding window` for sliding layers.

    With `pooled` (the head-pooled layout, docs/DESIGN.md), the `kv_heads x slots` slots of a row form one pool any
    head's entry may occupy: slot `s` of row `i` holds head `owner[b, i, s]`'s entry (when its position is >= 0).
    Unpooled, `owner[b, i, s] = i` always (the kernel never reads it)."""

    # Fixed shapes, so it does compile; False keeps generate() from building 4-D masks we never use (and from
    # hiding the 2-D padding mask that BudgetForward checks) and from compiling the forward a second time.
    is_compileable = False
    is_sliding = False
    is_croppable = True  # `BudgetCache.crop` drops the newest tokens where exact and refuses elsewhere

    def __init__(self, *, layer: int, budget: int, slots: int, sliding: int, batch_size: int, kv_heads: int,
                 head_dim: int, v_head_dim: int, dtype: torch.dtype, device: torch.device,
                 inv_freq: Tensor | None = None, call: CallPositions | None = None, pooled: bool = False,
                 q_heads: int | None = None, slot_dtype: str = "model"):
        super().__init__()
        self.call = call if call is not None else CallPositions()
        self.layer, self.budget, self.slots, self.sliding = layer, budget, slots, sliding
        self.pooled = bool(pooled) and not sliding  # sliding layers hold their window, not a budget: never pooled
        self.is_sliding = bool(sliding)
        self.batch_size, self.num_heads = batch_size, kv_heads
        # Keys and values in the model's dtype, or quantized rows of codes and a scale (`kernel.slot_storage`).
        self.slot_dtype, self.head_dim, self.v_head_dim = slot_dtype, head_dim, v_head_dim
        storage, k_width = slot_shape(slot_dtype, head_dim)
        v_width = slot_shape(slot_dtype, v_head_dim)[1]
        self.keys = torch.zeros(batch_size, kv_heads, slots, k_width, dtype=storage or dtype, device=device)
        # The device as the tensors report it ("cuda" resolves to "cuda:0"): compared with a weight's or a call's.
        self.dtype, self.device = dtype, self.keys.device
        self.values = torch.zeros(batch_size, kv_heads, slots, v_width, dtype=storage or dtype, device=device)
        self.pos = torch.full((batch_size, kv_heads, slots), -1, dtype=torch.long, device=device)
        self.state = torch.zeros(batch_size, kv_heads, slots, dtype=torch.float32, device=device)
        # The per-token signals of each cached entry (`kernel.signals.TOKEN_SIGNALS`), measured once when it is written.
        self.norms = torch.zeros(batch_size, kv_heads, slots, len(TOKEN_SIGNALS), dtype=torch.float32, device=device)
        # Per-call totals of each kernel signal (kernel.state.TOTALED): diagnostics, and what keeps every signal live.
        self.totals = torch.zeros(batch_size, kv_heads, len(TOTALED), dtype=torch.float32, device=device)
        self.owner = torch.empty(batch_size, kv_heads, slots, dtype=torch.int32, device=device)
        self._own_rows()
        self.seen = torch.zeros((), dtype=torch.long, device=device)  # total tokens seen: RoPE keeps counting
        self.keep = budget  # entries kept per call: the budget, or every slot while eviction is frozen
        # RoPE frequencies of this layer's keys/queries (a signal for rules that model future queries); NaN if unknown.
        self.inv_freq = (inv_freq if inv_freq is not None else torch.full((head_dim // 2,), float("nan"))).to(device)
        # Post-RoPE keys and queries are this factor times a rotation (the rotary embedding's `attention_scaling`:
        # YaRN's; 1 for default RoPE), known from the model (`BudgetCache.set_rope`); 1 from a config alone.
        self.rope_scaling = 1.0
        self.rope_known = inv_freq is not None  # from the config (or `BudgetCache.set_rope`): no device read
        # The layer's output projection as the `wov_norm` signal reads it (per query head, the R of W_o's slice:
        # `kernel.signals.out_projection_factors`), set by `BudgetCache.set_output_projections`; NaN while unknown.
        # Not KV bytes (`kv_bytes`): q_heads x v_head_dim^2 floats per layer, v_head_dim / hidden of the o_proj weight.
        self.q_heads = q_heads or kv_heads
        self.wo = unknown_wo(kv_heads, self.q_heads // kv_heads, v_head_dim, device)
        self.wo_known = False
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):  # allocated eagerly in __init__
        pass

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return self.mark(key_states, value_states, self.layer)

    def mark(self, key_states: Tensor, value_states: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """`update` with the layer index the marker carries: this layer's own, or -1 from a compiled region that
        several layers share (`fxbudget.compiler.regions`: an index in the graph would make every layer a graph of its own).
        The index only labels the call (the pass's report, the eager path's errors); the kernel never reads it."""
        b, _, n, _ = key_states.shape
        # Only a call longer than the slots is told the cache is empty (a static argument: a graph of its own): its
        # skipped slots are worth a graph; a shorter call keeps the graph it shares with calls on a filled cache.
        empty = n > self.slots and self.call.empty
        if self.call.pos is None:
            new_pos = (torch.arange(n, device=self.device) + self.seen).expand(b, n)
            self.seen.add_(n)
        else:
            new_pos, advance = self.call.pos, self.call.advance
            if new_pos.device != self.device:  # a model spread over devices: this layer's own (no op otherwise)
                new_pos, advance = new_pos.to(self.device), advance.to(self.device)
            self.seen.add_(advance)
        tensors = marker_tensors(self.kernel_slots(), NewTokens(key_states, value_states, new_pos),
                                 LayerConstants(self.inv_freq, self.wo))
        k, v = torch.ops.fxbudget.candidates(*tensors, layer, self.budget, self.keep, self.sliding, self.pooled,
                                              empty)
        if not torch.compiler.is_compiling():
            mode = require_interceptor()  # eager: the interceptor must be active, or SDPA would be wrong
            call = MarkerCall(tensors, self.layer, self.budget, self.keep, self.sliding, self.pooled, empty)
            k._fxbudget, v._fxbudget = call, call
            mode.pending[id(call)] = self.layer
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask transformers builds from this is never used (visibility comes from positions); keep it well-formed.
        return self.slots + query_length, 0

    def get_seq_length(self) -> Tensor:
        return self.seen

    def get_max_length(self) -> int:
        return self.slots

    def kernel_slots(self) -> LayerSlots:
        """The layer's slots as the kernel names them (the same tensors, not copies)."""
        return LayerSlots(*(getattr(self, n) for n in SLOT_FIELDS))

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor the compiled kernel reads or writes in place (what `BudgetCache.mark_static` marks): the
        layer's state, then its constants."""
        return tuple(getattr(self, n) for n in LAYER_STATE + LAYER_CONSTANTS)

    def snapshot(self) -> dict[str, Tensor]:
        """A copy of every state tensor (`LAYER_STATE`), for `load`."""
        return {n: getattr(self, n).clone() for n in LAYER_STATE}

    def load(self, state: dict[str, Tensor]) -> None:
        """Write a `snapshot` (of this layer, or of a layer of the same shapes) back in place: bit-identical."""
        for n in LAYER_STATE:
            getattr(self, n).copy_(state[n])

    def drop_from(self, first: Tensor, r: int) -> None:
        """Empty the slots holding a position >= `first[b]` of their row and count `r` tokens fewer seen
        (`BudgetCache.crop`; `fxbudget.cache.speculative.drop_slots`)."""
        speculative.drop_slots(self, first, r)

    def head_positions(self) -> Tensor:
        """The positions each KV head holds, `[batch, kv_heads, C]` (-1 = none): `C = slots` unpooled, `kv_heads x
        slots` pooled (head `j`'s row lists the pool's slots, its own entries' positions, -1 elsewhere)."""
        if not self.pooled:
            return self.pos.clone()
        b, h, S = self.pos.shape
        heads = torch.arange(h, device=self.pos.device, dtype=self.owner.dtype).view(1, h, 1)
        pos, owner = self.pos.reshape(b, 1, h * S), self.owner.reshape(b, 1, h * S)
        return torch.where((owner == heads) & (pos >= 0), pos, -1)

    def head_counts(self) -> Tensor:
        """Entries held per KV head, `[batch, kv_heads]` (long)."""
        return (self.head_positions() >= 0).sum(dim=-1)

    def _own_rows(self) -> None:
        # owner[b, i, s] = i: each row's slots belong to its own head (the unpooled layout; a pool's initial state).
        self.owner.copy_(torch.arange(self.num_heads, dtype=torch.int32, device=self.owner.device).view(1, -1, 1)
                         .expand_as(self.owner))

    def reset(self) -> None:
        for n in LAYER_STATE:
            if n == "owner":
                self._own_rows()
            else:
                getattr(self, n).fill_(-1 if n == "pos" else 0)


# Config reading lives in `fxbudget.models.layer_config` (each layer's window as transformers' mask code decides it, RoPE
# frequencies with partial rotary); these names stay for importers.
_layer_shapes = layer_shapes


class BudgetCache(Cache):
    """A transformers `Cache` that keeps at most `budget` KV entries per layer and KV head.

    Full-attention layers hold `budget + headroom` slots and evict down to `budget` on every call that overflows it
    (the rule decides which). Sliding-window layers hold exactly their window and are not budgeted: those of
    `config.layer_types`, or every layer under a model-wide `sliding_window` (Mistral, Phi-3, Starcoder2), as the
    model's mask code decides (`fxbudget.models.layer_config.layer_windows`).

    Args:
        config: the model config (a transformers config, or any object with `num_hidden_layers`,
            `num_attention_heads`, `num_key_value_heads`, `head_dim` or `hidden_size`, optional `layer_types` and
            `sliding_window`).
        budget: KV entries kept per full-attention layer and KV head (sinks and windows count against it).
        batch_size: rows per call; the cache serves only this batch size.
        dtype, device: of the cached keys/values (default: float32 on CPU); must match the model. `device` may be a
            list with one device per layer, for a model whose layers are spread over devices (`device_map="auto"`):
            each layer's slots then live on its layer's device (`fxbudget.api.layer_devices(model)`).
        headroom: extra slots filled while eviction is frozen (`with cache.frozen(): ...`), e.g. for the question
            and answer appended after a compressed context (DESIGN §6, query-agnostic protocol).
        interval: decode steps between evictions (kvpress DecodingPress's `compression_interval`; 1, the default,
            evicts on every call). With `interval = k > 1` a one-token call (a decode step) that is not evicting
            frozen appends without eviction, except every k-th since the last evicting call, which evicts down to
            the budget (its `target_size`); calls of more tokens evict as before. Between evictions a layer holds
            up to `budget + k - 1` entries, the evicting call attends over up to `budget + k`, and right after it
            the layer holds the budget: the cache allocates `budget + max(headroom, k - 1)` slots (the head-room
            and the growth share the extra slots; docs/DESIGN.md §3, "Decoding at an interval").
        layer_budgets: per-layer budgets of the full-attention layers (e.g. PyramidKV's schedule); they must sum to
            `budget` times the number of those layers, so the cache holds the same memory as a uniform one.
        head_pool: the head-pooled layout: each full-attention layer's `kv_heads x (budget + headroom)` slots are
            one pool the heads share, so a head-adaptive rule (`AdaKV`) can spread the layer's `kv_heads x budget`
            entries unevenly over the heads in the same memory (docs/DESIGN.md). A uniform rule runs on it too (its
            kept sets are the unpooled layout's). Sliding layers are never pooled.
        slot_dtype: how slots store keys and values (`checks.SLOT_DTYPES`): None or "model" in
            `dtype`; "float8_e4m3fn", "int8" or "int4" quantized per entry and head with a float32 scale (a kernel
            setting: the measure phase and the rule read the stored values; a call's new tokens are attended in
            `dtype`). `kv_bytes` and `held_kv_bytes` count the stored bytes, scales included.
    """

    # transformers 5.25 asks before its first crop in assisted decoding (and before deferring a stop on MPS);
    # `crop` itself refuses whatever it cannot drop exactly (`fxbudget.cache.speculative`).
    is_croppable = True

    def __init__(self, config, budget: int, batch_size: int = 1, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | list | tuple | None = None, headroom: int = 0,
                 layer_budgets: list[int] | None = None, head_pool: bool = False, interval: int = 1,
                 slot_dtype: str | None = None):
        if not isinstance(head_pool, bool):
            raise ValueError(f"head_pool must be a bool, got {head_pool!r}")
        slot_dtype = check_slot_dtype(slot_dtype)
        for name, val, low in (("budget", budget, 1), ("batch_size", batch_size, 1), ("headroom", headroom, 0),
                               ("interval", interval, 1)):
            check_int(name, val, low)
        n_layers, kv_heads, head_dim, heads, types = layer_shapes(config)
        windows = layer_windows(config)  # 0 = full attention: what the model's own mask code applies
        cfg = text_config(config)
        dtype = dtype or torch.get_default_dtype()
        if isinstance(device, (list, tuple)):
            if len(device) != n_layers:
                raise ValueError(f"device: one per layer ({n_layers}) or a single one, got {len(device)}")
            devices = [torch.device(d) for d in device]
        else:
            devices = [torch.device(device or "cpu")] * n_layers
        n_full = types.count("full_attention")
        if layer_budgets is not None:
            layer_budgets = list(layer_budgets)
            if len(layer_budgets) != n_full or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                                   for b in layer_budgets):
                raise ValueError(f"layer_budgets must be {n_full} ints >= 1 (one per full-attention layer), "
                                 f"got {layer_budgets}")
            if sum(layer_budgets) != n_full * budget:
                raise ValueError(f"layer_budgets sum to {sum(layer_budgets)}, not {n_full} layers x budget {budget} "
                                 f"= {n_full * budget}: every rule must hold the same memory")
        full_budgets = iter(layer_budgets or [budget] * n_full)
        layers = []
        self.call = CallPositions()  # set by BudgetForward around each call; shared by every layer
        for i, t in enumerate(types):
            sliding = windows[i]
            b = sliding or next(full_budgets)
            inv_freq = layer_inv_freq(cfg, i, t, head_dim)
            layers.append(BudgetLayer(
                layer=i, budget=b, slots=sliding or b + max(headroom, interval - 1), sliding=sliding,
                batch_size=batch_size, kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim,
                dtype=dtype, device=devices[i], inv_freq=inv_freq, call=self.call, pooled=head_pool, q_heads=heads,
                slot_dtype=slot_dtype))
        super().__init__(layers=layers)
        self.budget, self.headroom, self.dtype, self.head_pool = budget, headroom, dtype, head_pool
        self.slot_dtype = slot_dtype
        self.interval = interval
        self._since = 0  # decode steps since the last evicting call (`interval`)
        self.evicting = True  # whether the call being admitted may evict (False: frozen, or between evictions)
        self.devices, self.device = devices, devices[0]  # each layer's; the first layer's (positions live there)
        self.layer_budgets = [layer.budget for layer in self._budgeted()]
        # Every budgeted layer's frequencies known (`set_rope` may add them); kept on the Python side, never read back.
        self.has_rope = all(layer.rope_known for layer in self._budgeted())
        self.signature = (n_layers, kv_heads, head_dim, heads, types)  # what the cache was built for
        self._frozen = False
        # The next position of each row (rows of a left-padded batch have seen different numbers of tokens).
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        # Entries held per budgeted layer, tracked on the Python side to check head-room before a call runs.
        self._held = [0] * len(self.layer_budgets)
        self._empty = True  # no token admitted yet (every layer, sliding ones included): `empty`
        self._reset_crop()

    # What `crop` reads to know whether dropping the newest tokens is exact (`fxbudget.cache.speculative`), kept on
    # the Python side by `admit`: the last call's length and whether it evicted, the tokens admitted since the last
    # call that evicted, and whether a crop left rejected queries' attention in the kept entries' state.
    def _reset_crop(self) -> None:
        self._last, self._clean, self._speculated = (0, False), 0, False

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` tokens of every row (what assisted generation and prompt lookup call
        to drop the rejected draft tokens): their slots emptied (positions, carried state, per-token signals) and
        the counts (`get_seq_length()`, each row's next position, the entries held) taken back.

        Raises:
            ValueError: where it cannot be exact: the tokens dropped (or a multi-token call cropped by 0) took part
                in a call that evicted, or a full sliding-window layer would lose part of its window
                (`fxbudget.cache.speculative`); a positive value (transformers' legacy absolute length).
        """
        speculative.crop(self, tokens_to_remove)

    def activate_past_recording(self, **kwargs) -> None:
        """Called by `generate()` on the cache it was given before assisted decoding starts: a cache whose next
        call evicts (full, eviction not frozen) is refused here, before any draft is made."""
        if not self._frozen and not self.fits(1):
            raise speculative.refusal(self, speculative.FULL)
        super().activate_past_recording(**kwargs)

    @property
    def has_wo(self) -> bool:
        """Whether every budgeted layer carries its model's output projection (`set_output_projections`)."""
        return all(layer.wo_known for layer in self._budgeted())

    def set_rope(self, entries: list) -> None:
        """Attach each layer's RoPE as the model applies it (`fxbudget.cache.rope.model_rope(model)`): per layer
        `(inv_freq [r/2], attention_scaling)`; a str (why it is unknown) makes the layer's frequencies unknown (NaN);
        None keeps what the config gave. A cache built for a model (`model_cache`) takes them so; a cache built from
        a config alone knows default RoPE only. `has_rope` is recomputed over the budgeted layers.

        Raises:
            ValueError: one entry per layer is needed; frequencies must be 1-D with at most head_dim / 2 entries.
        """
        if len(entries) != len(self.layers):
            raise ValueError(f"set_rope: {len(entries)} entries for {len(self.layers)} layers")
        for layer, entry in zip(self.layers, entries):
            head_dim = layer.head_dim
            if entry is None:
                continue
            if not isinstance(entry, tuple):
                layer.inv_freq = torch.full((head_dim // 2,), float("nan"), device=layer.device)
                layer.rope_scaling = 1.0
                layer.rope_known = False
                continue
            inv_freq, scaling = entry
            if inv_freq.dim() != 1 or not 0 < inv_freq.shape[0] <= head_dim // 2:
                raise ValueError(f"layer {layer.layer}: RoPE frequencies of shape {tuple(inv_freq.shape)} for head "
                                 f"dim {head_dim}")
            # Known or not is read on the entry's own device (the CPU), never back from the layer's: a layer may
            # live on a device that cannot be read (meta, for an offloaded model) or whose reads sync.
            layer.rope_known = not bool(torch.isnan(inv_freq.detach().cpu()).any())
            layer.inv_freq = inv_freq.detach().to(layer.device, torch.float32).clone()
            layer.rope_scaling = float(scaling)
        self.has_rope = all(layer.rope_known for layer in self._budgeted())

    def set_output_projections(self, weights: list[Tensor | None]) -> None:
        """Attach each layer's output projection weight (`o_proj.weight`, `[hidden, q_heads * v_head_dim]`, None =
        unknown), the `wov_norm` signal's W_o. The layer keeps its per-query-head R factors
        (`kernel.signals.out_projection_factors`, computed once per weight), not the weight.

        Raises:
            ValueError: one weight per layer is needed, each on its layer's device and of the expected width.
        """
        if len(weights) != len(self.layers):
            raise ValueError(f"set_output_projections: {len(weights)} weights for {len(self.layers)} layers")
        for layer, w in zip(self.layers, weights):
            if w is None:
                continue
            width = layer.q_heads * layer.v_head_dim
            if w.dim() != 2 or w.shape[1] != width or w.device != layer.device:
                raise ValueError(f"layer {layer.layer}: output projection of shape {tuple(w.shape)} on {w.device}; "
                                 f"expected [hidden, {width}] on {layer.device}")
            layer.wo = out_projection_factors(w, layer.num_heads, layer.v_head_dim)
            layer.wo_known = True

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size

    def positions(self, layer_idx: int) -> Tensor:
        """Original positions held by a layer's slots, `[batch, kv_heads, slots]` (-1 = empty slot). On the
        head-pooled layout a slot's row is not its head: read `head_positions` for what each head holds."""
        return self.layers[layer_idx].pos.clone()

    def head_positions(self, layer_idx: int) -> Tensor:
        """The positions each KV head of a layer holds, `[batch, kv_heads, C]` (-1 = none), in either layout:
        `C = slots` unpooled, `kv_heads x slots` pooled (`BudgetLayer.head_positions`)."""
        return self.layers[layer_idx].head_positions()

    def head_counts(self, layer_idx: int) -> Tensor:
        """Entries each KV head of a layer holds, `[batch, kv_heads]`."""
        return self.layers[layer_idx].head_counts()

    def get_seq_length(self, layer_idx: int = 0) -> Tensor:
        """Total tokens seen (a 0-d tensor, so position ids keep growing without recompiles), not slots filled."""
        return self.layers[layer_idx].seen

    @property
    def tokens_seen(self) -> int:
        return int(self.layers[0].seen)

    def kv_bytes(self) -> int:
        """Bytes allocated for cached keys and values (all layers, every slot: empty ones and head-room included)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))

    def held_kv_bytes(self) -> int:
        """Bytes of keys and values held: the slots that hold a token (all layers, rows and KV heads)."""
        return sum(int((layer.pos >= 0).sum()) * (layer.keys.shape[-1] * layer.keys.element_size()
                                                  + layer.values.shape[-1] * layer.values.element_size())
                   for layer in self.layers)

    @contextlib.contextmanager
    def frozen(self):
        """Switch eviction off for the calls inside: new tokens go into the head-room, nothing is evicted."""
        if self._frozen:
            raise RuntimeError("BudgetCache.frozen() is not re-entrant")
        self._frozen, self.evicting = True, False
        for layer in self._budgeted():
            layer.keep = layer.slots  # a static kernel argument: frozen calls compile their own graph
        try:
            yield self
        finally:
            self._frozen, self.evicting = False, True
            for layer in self._budgeted():
                layer.keep = layer.budget

    def mark_static(self) -> None:
        """Mark every layer's tensors as inputs whose address never changes (`torch._dynamo.mark_static_address`),
        so Inductor's CUDA graphs may write them in place (it skips CUDA graphs for a graph that mutates other
        inputs). Unguarded: the decoder layers share one compiled region, each with its own cache tensors, so a
        guard on the addresses would compile the region once per layer; instead CUDA graph trees record the region
        once per layer (and re-record if a marked address ever changed). The tensors are allocated in `__init__`
        and only written in place (`reset` included), so their addresses hold for the cache's life. Idempotent."""
        if getattr(self, "static", False):
            return
        for layer in self.layers:
            for t in layer.tensors():
                torch._dynamo.mark_static_address(t, guard=False)
        self.static = True

    def fits(self, n: int) -> bool:
        """Whether `n` more tokens fit in every budgeted layer without evicting anything."""
        return all(held + n <= b for held, b in zip(self._held, self.layer_budgets))

    def admit(self, n: int, *, length: int | None = None) -> None:
        """Account for a call of `n` new tokens (`length` with pads, default `n`) before it runs; raises if frozen
        and the head-room is too small. With an `interval` > 1, decides whether a decode step (`length` 1) evicts
        (`evicting`; the layers' `keep`): see `grows`."""
        length = n if length is None else length
        grow = not self._frozen and self.grows(n, length)
        drops = not self._frozen and not grow and not self.fits(n)  # the call evicts an entry it held
        if drops and self._speculated:
            raise speculative.refusal(self, speculative.STALE, speculative.STALE_FIX)
        if self._frozen:
            if any(held + n > b + self.headroom for held, b in zip(self._held, self.layer_budgets)):
                raise RuntimeError(
                    f"eviction is frozen and {n} new tokens do not fit: {max(self._held)} held, budget "
                    f"{self.budget} + headroom {self.headroom}; build the cache with a larger headroom=")
            self._held = [held + n for held in self._held]
        elif self.interval > 1:
            self._since = self._since + 1 if grow else 0
            self.evicting = not grow
            for layer in self._budgeted():  # a static kernel argument: growing steps run the frozen graph
                layer.keep = layer.slots if grow else layer.budget
            self._held = [held + n if grow else min(held + n, b) for held, b in zip(self._held, self.layer_budgets)]
        else:
            self._held = [min(held + n, b) for held, b in zip(self._held, self.layer_budgets)]
        self._empty = self._empty and n == 0
        self._last, self._clean = (length, drops), 0 if drops else self._clean + length

    def grows(self, n: int, length: int) -> bool:
        """Whether a call of `length` tokens (`n` real) appends without evicting under this cache's `interval`: a
        decode step (`length` 1) that is not the `interval`-th since the last evicting call, and whose token fits in
        every budgeted layer's `budget + interval - 1` (after frozen calls filled the head-room, it evicts). Every
        other call evicts (and restarts the count). Always False with interval 1 (every call evicts)."""
        return (self.interval > 1 and length == 1 and self._since + 1 < self.interval
                and all(held + n <= b + self.interval - 1 for held, b in zip(self._held, self.layer_budgets)))

    @property
    def empty(self) -> bool:
        """No token admitted since the cache was built or reset (or in the restored snapshot): every slot of every
        layer is empty. Kept on the Python side (no read-back), so a compiled call can be told (`CallPositions`)."""
        return self._empty

    def snapshot(self) -> dict:
        """Every layer's state (`BudgetLayer.snapshot`) and the cache's own bookkeeping, for `restore`."""
        return {"layers": [layer.snapshot() for layer in self.layers], "held": list(self._held),
                "empty": self._empty, "next_pos": self.next_pos.clone(), "since": self._since,
                "crop": (self._last, self._clean, self._speculated)}

    def restore(self, snap: dict) -> None:
        """Put a `snapshot` back, in place (the tensors keep their addresses: a compiled forward sees the same
        inputs); every tensor bit-identical to when it was taken."""
        for layer, state in zip(self.layers, snap["layers"]):
            layer.load(state)
        self._held, self._empty = list(snap["held"]), snap["empty"]
        self._since = snap.get("since", 0)
        self._last, self._clean, self._speculated = snap.get("crop", ((0, False), 0, False))
        self.next_pos.copy_(snap["next_pos"])

    def reset(self) -> None:
        super().reset()
        for layer in self._budgeted():
            layer.keep = layer.budget
        self._held, self._frozen, self._empty = [0] * len(self.layer_budgets), False, True
        self._since, self.evicting = 0, True
        self._reset_crop()
        self.next_pos.zero_()

    def _budgeted(self):
        return [layer for layer in self.layers if not layer.sliding]
