"""Deliberate packing bugs, to prove that an equivalence test can fail and to measure how small a bug it catches.

Both leave a model run on one example alone exactly as it was, and change only packed rows:

* :func:`leak_across_boundaries`: after one layer, the first token of every example but the first receives
  ``strength ×`` the hidden state of the token before it, the last token of the previous example;
* :func:`positions_run_on`: learned absolute positions number the whole packed row instead of restarting at every
  example;
* :func:`completions_see_a_sibling` and :func:`completion_positions_restart`: the two ways a row with shared prefixes
  (:mod:`padfree_plugins.packing.prefixes`) can go wrong — a completion that sees a token of its sibling, a
  completion whose positions restart at 0 instead of continuing from its prompt; :func:`branch_sees_a_sibling_branch`
  the first alone two or more levels down a prefix tree;
* :func:`examples_merge_under_compile` and :func:`boundary_guard_silenced`: the two ways a compiled forward can go
  wrong — attention that lets an example see its neighbour, a guard that no longer refuses wrong boundaries;
* :func:`tile_drops_last_token` and :func:`loss_normalised_per_tile`: the two ways tiled computation
  (:mod:`padfree_plugins.modeling.tiling`) can go wrong — a feed-forward tile that loses its last token's output, a
  tiled loss that averages each tile on its own instead of dividing the row's sum once;
  :func:`held_gather_never_let_go`: under DeepSpeed ZeRO-3, a tiled feed-forward whose parameters, held gathered over
  its tiles, are never let go (they stay gathered after the layer's call: a leak);
* :func:`mixer_tile_starts_from_zero`: a hybrid's sequence mixer scanned in tiles (``memory.tile_mixers``) whose
  every tile starts an example cut by the previous tile from zeros (no recurrent state, no conv taps);
  :func:`mixer_recompute_takes_any_stash`: its checkpoint's recompute taking the output another row's scan kept
  (any of the same tiles, its input not compared);
* :func:`rows_swap_media`: a padded image-text call split wrongly — two rows' media (of the same shapes, other
  pixels) swapped, so each row's tokens get the other's images;
* :func:`context_keys_from_own_slice_only` and :func:`context_queries_one_token_ahead`: the two ways all-gather
  sequence parallelism (:mod:`padfree_plugins.modeling.attention.context_parallel`) can go wrong — a rank that
  attends only to its own slice's keys, queries placed one token off (each sees the next token of its example);
  :func:`zigzag_chunks_masked_as_one_run` and :func:`zigzag_outputs_to_wrong_rank`: the two ways its balanced causal
  work (:class:`~padfree_plugins.modeling.attention.context_parallel.Zigzag`) can go wrong — a rank's second chunk of
  queries masked as if it followed its first (the mask misaligned across the exchange), outputs sent back to the
  wrong ranks;
* :func:`image_features_to_another_group`: a row that shares image-text prompts with one group's image features in
  another group's prompt;
* :func:`completions_start_from_zero`, :func:`completions_continue_a_sibling` and
  :func:`conv_taps_reach_into_a_sibling`: the three ways a hybrid's sequence mixers can go wrong in a row with shared
  prefixes — a completion's state not taken from its prompt, taken from its sibling, its conv taps in its sibling;
  :func:`conv_taps_stop_at_the_parent`: in a prefix tree, taps that do not reach past a short branch point;
* :func:`pooling_reads_local_slice`: a task that pools whole examples under sequence parallelism reads only the
  hidden states of this rank's slice of the row (no exchange), zeros where another rank computed them;
* :func:`parent_keys_not_exchanged`: a row with shared prefixes split across a sequence-parallel group's ranks whose
  completions see zeros for the keys and values of a prompt that another rank's slice holds (the structure applied
  to the rank's own slice only);
* :func:`image_features_sliced_off_by_one`: an image-text row under sequence parallelism whose merged embeddings
  (image features and text) every rank after the first cuts one token early, its positions cut right;
* :func:`mixer_scans_only_its_slice` and :func:`state_from_wrong_rank`: the two ways sequence mixers split across the
  ranks of a sequence-parallel group (:mod:`padfree_plugins.modeling.split_mixers`) can go wrong — the piece of an
  example after a cut starting from zeros, or from a state that is not the previous rank's;
* :func:`tower_gradients_not_summed`: an image-text row under sequence parallelism whose gathered image features
  (:mod:`padfree_plugins.modeling.tower_share`) hand each rank's tower only its own slice's gradient of its images'
  features, not the group's sum;
  :func:`child_starts_from_rank_predecessor`: in a shared row, a completion whose prompt ended on an earlier rank
  starting from the state its previous rank handed on last instead of its prompt's;
* :func:`dummy_calls_untied`: under DeepSpeed ZeRO-3, the calls a rank makes of a sequence mixer on zeros to match
  another rank's number of calls (:func:`~padfree_plugins.modeling.mixers.equal_calls`) left out of the autograd
  graph: the forward matches, the backward does not (its ranks' gathers stop pairing up).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any
from unittest import mock

import torch

from padfree_plugins.modeling import attention, mixers, patching, split_mixers, tiled_mixers, tiling, tower_share
from padfree_plugins.modeling.attention import backends, context_parallel
from padfree_plugins.modeling.patching import unwrap_model
from padfree_plugins.modeling.sequence_parallel import SequenceParallelForward, SliceRow
from padfree_plugins.packing import multimodal
from padfree_plugins.packing.batch import restarts
from padfree_plugins.packing.prefixes import SharedPrefixes


def layers_of(model: Any) -> torch.nn.ModuleList:
    """The model's stack of transformer layers: its decoder's ``layers``, or else its first ``ModuleList`` of
    ``num_hidden_layers`` modules."""
    inner = unwrap_model(model)
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    if isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):  # a VLM: its language model's layers
        return decoder.layers
    count = getattr(inner.config.get_text_config(), "num_hidden_layers", None)
    lists = [module for module in inner.modules() if isinstance(module, torch.nn.ModuleList) and len(module)]
    for candidate in lists:
        if count is None or len(candidate) == count:
            return candidate
    raise ValueError(f"no stack of {count} layers found in {type(inner).__name__}")


def _hidden(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _replace_hidden(output: Any, hidden: torch.Tensor) -> Any:
    if isinstance(output, tuple):
        return (hidden, *output[1:])
    if isinstance(output, list):
        return [hidden, *output[1:]]
    return hidden


@contextmanager
def leak_across_boundaries(model: Any, strength: float = 1e-3, layer: int = 0,
                           backward_only: bool = False) -> Iterator[None]:
    """Within the block, the output of layer ``layer`` leaks across example boundaries on packed rows: the first
    token of example ``i > 0`` gets ``strength ×`` the previous token's hidden state added (a relative leak of
    about ``strength``). A row of one example, or a padded batch, is left alone. Works patched or not: the
    boundaries are read from ``cu_seq_lens_q`` (or from where ``position_ids`` restart) of the base model's call.

    ``backward_only=True`` leaks gradients only: the forward values stay exact (the leak is added and subtracted
    detached), but gradients flow back across the boundary, as from a wrong backward kernel.
    """
    inner = unwrap_model(model)
    base = getattr(inner, "base_model", inner)
    target = layers_of(inner)[layer]
    state: dict[str, Any] = {}

    def record(module: Any, args: tuple, kwargs: dict) -> None:
        cu = kwargs.get("cu_seq_lens_q")
        state["cu"] = cu.long().cpu() if isinstance(cu, torch.Tensor) else restarts(kwargs.get("position_ids"))

    def forget(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        state.pop("cu", None)

    def leak(module: Any, args: tuple, output: Any) -> Any:
        cu = state.get("cu")
        if cu is None or cu.numel() <= 2:
            return None
        hidden = _hidden(output)
        mask = torch.zeros(hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        mask[cu[1:-1].to(hidden.device)] = strength
        previous = torch.roll(hidden, 1, dims=1)
        if backward_only:
            previous = previous - previous.detach()
        return _replace_hidden(output, hidden + mask[None, :, None] * previous)

    handles = [base.register_forward_pre_hook(record, with_kwargs=True),
               base.register_forward_hook(forget, with_kwargs=True, always_call=True),
               target.register_forward_hook(leak)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _run_on(position_ids: torch.Tensor) -> torch.Tensor:
    """Positions counting on from the row's first one: what a model that ignores the restarts would use."""
    start = position_ids[..., :1]
    return start + torch.arange(position_ids.shape[-1], device=position_ids.device, dtype=position_ids.dtype)


@contextmanager
def positions_run_on(model: Any) -> Iterator[None]:
    """Within the block, the model's learned absolute position table is looked up at ``p, p+1, …`` across a packed
    row from its first position, instead of at positions restarting at every example; an example run alone gets
    the same positions as before. The model's inputs are unchanged, so the patch's guard sees nothing.

    Only absolute positions (BERT-style ``position_embeddings``, GPT-2's ``wpe``): rotary embeddings see only
    distances within an example, so a RoPE model with positions running on computes the same attention."""
    inner = unwrap_model(model)
    tables = [m for name, m in inner.named_modules()
              if isinstance(m, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in ("position_embeddings", "wpe")]
    if not tables:
        raise ValueError(f"{type(inner).__name__} has no learned position table (position_embeddings / wpe); "
                         "rotary positions are shift-invariant, so positions running on would change nothing")

    def table_positions(module: Any, args: tuple) -> tuple:
        return (_run_on(args[0]), *args[1:])

    with ExitStack() as stack:
        for module in tables:
            stack.callback(module.register_forward_pre_hook(table_positions).remove)
        yield


@contextmanager
def completions_see_a_sibling() -> Iterator[None]:
    """Within the block, every segment of a shared row that follows a sibling (another child of its parent: a
    completion of its prompt, a branch of a prefix tree) also attends to that sibling's first token: one key more, as
    from a kernel that leaks across siblings. Inside attention, past the model's guard."""
    with _siblings_leak(deepest_only=False):
        yield


@contextmanager
def branch_sees_a_sibling_branch() -> Iterator[None]:
    """Within the block, only the segments two or more levels down a prefix tree (a branch under a branch: a later
    turn's continuation, its completions) attend to their previous sibling's first token as well; one-level rows
    are untouched. Inside attention, past the model's guard."""
    with _siblings_leak(deepest_only=True):
        yield


@contextmanager
def _siblings_leak(deepest_only: bool) -> Iterator[None]:
    original = attention._shared_keys

    def leaking(module, backend, shared: SharedPrefixes, key, value, causal, blocks):
        keys, values, cu_k, _ = original(module, backend, shared, key, value, causal, blocks)
        bounds = shared.cu_seq_lens_k.long().tolist()
        last_child: dict[int, int] = {}
        pieces, sizes = [], []
        for segment, parent in enumerate(shared.parents):
            start, end = bounds[segment], bounds[segment + 1]
            piece = torch.arange(start, end)
            if parent >= 0 and (not deepest_only or shared.parents[parent] >= 0):
                ancestors = bounds[parent + 1] - bounds[parent]  # the parent's keys: its ancestors' and its own
                if parent in last_child:  # the sibling's first own key, after the ancestors' keys
                    sibling = bounds[last_child[parent]] + ancestors
                    piece = torch.cat([piece[:ancestors], torch.tensor([sibling]), piece[ancestors:]])
                last_child[parent] = segment
            pieces.append(piece)
            sizes.append(piece.numel())
        index = torch.cat(pieces).to(keys.device)
        cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device=keys.device)
        return keys.index_select(0, index), values.index_select(0, index), cu, max(sizes)

    with mock.patch.object(attention, "_shared_keys", leaking):
        yield


@contextmanager
def completion_positions_restart() -> Iterator[None]:
    """Within the block, the positions of every completion of a row with shared prefixes restart at 0 instead of
    continuing from its prompt's end (however the row was packed: a padded call, a collator), and the guard that
    refuses such a row is off (as a model on an accelerator, where the guard reads nothing, would run it). The
    positions are rewritten where the guard reads them, in the tensor the model goes on to use."""

    def restarting(cu, cu_k, position_ids, shared, sequence) -> None:
        bounds = cu.long().tolist()
        for segment, parent in enumerate(shared.parents):
            if parent >= 0:
                start, end = bounds[segment], bounds[segment + 1]
                position_ids[..., start:end] = torch.arange(end - start, device=position_ids.device)

    with mock.patch.object(patching, "_check_shared_prefixes", restarting):
        yield


@contextmanager
def examples_merge_under_compile() -> Iterator[None]:
    """Within the block, the compiled paths of ``exact`` (the ``padfree::exact_varlen`` op and the row-masked call,
    :mod:`padfree_plugins.modeling.attention.backends`) move the row's first inner boundary one token late: the first
    example attends to the first token of the next one. An eager forward is unchanged; compile inside the block (a
    graph traced before it keeps the right boundaries)."""
    op, places = backends.exact_varlen_op, backends._token_places

    def merged(cu_seq_lens: torch.Tensor) -> torch.Tensor:  # tensor ops only (n is symbolic): T stays the end
        return torch.cat([cu_seq_lens[:1], torch.minimum(cu_seq_lens[1:2] + 1, cu_seq_lens[-1:]), cu_seq_lens[2:]])

    def merged_op(query, key, value, cu_seq_lens_q, cu_seq_lens_k, *options):
        return op(query, key, value, merged(cu_seq_lens_q), merged(cu_seq_lens_k), *options)

    with mock.patch.object(backends, "exact_varlen_op", merged_op), \
            mock.patch.object(backends, "_token_places", lambda cu, total: places(merged(cu), total)):
        yield


@contextmanager
def boundary_guard_silenced() -> Iterator[None]:
    """Within the block, the guard's device-side check (a compiled forward's, an accelerator's) passes whatever the
    boundaries: a forward given boundaries that would mix examples runs."""
    with mock.patch.object(patching, "_assert_packed_boundaries", lambda cu, cu_k, position_ids: None):
        yield


def _swappable(one: dict, two: dict) -> bool:
    """Two rows' media of the same keys, shapes and numbers of non-zero items (tiles padded with zeros count as
    none) whose pixels differ."""
    if not one or one.keys() != two.keys():
        return False
    tensors = [(torch.as_tensor(one[key]), torch.as_tensor(two[key])) for key in one]

    def items(value: torch.Tensor) -> int:
        return int(value.reshape(value.shape[0], -1).ne(0).any(1).sum()) if value.ndim > 1 else value.numel()

    return all(a.shape == b.shape and items(a) == items(b) for a, b in tensors) and \
        not all(torch.equal(a, b) for a, b in tensors)


@contextmanager
def rows_swap_media(collator: Any) -> Iterator[list[int]]:
    """``collator.split_call`` (a :class:`~padfree_plugins.packing.multimodal.MultimodalCollator`'s) giving the first
    two rows whose media can be swapped (same keys and shapes, other pixels) each other's media. Yields the number
    of calls swapped (one entry per call); a call with no such rows raises, so that a test cannot pass unswapped."""
    original = collator.split_call
    swapped: list[int] = []

    def split_call(inputs: Any, rows: Any) -> list[dict]:
        split = original(inputs, rows)
        for first in range(len(split)):
            for second in range(first + 1, len(split)):
                if _swappable(split[first], split[second]):
                    split[first], split[second] = split[second], split[first]
                    swapped.append(1)
                    return split
        raise AssertionError("rows_swap_media: no two rows of this call have media to swap")

    collator.split_call = split_call
    try:
        yield swapped
    finally:
        del collator.split_call


@contextmanager
def image_features_to_another_group(collator: Any) -> Iterator[list[int]]:
    """In a row that shares image-text prompts (:func:`~padfree_plugins.packing.multimodal.share_prompts`), the first
    two shared prompts whose media can be swapped (same keys and shapes, other pixels) hold each other's media: one
    group's image features fill another group's prompt. Yields the number of calls swapped (one entry per call); a
    shared call with no such prompts raises, so that a test cannot pass unswapped."""
    keys = set(collator.media_keys)
    original = multimodal.prompt_examples
    swapped: list[int] = []

    def prompt_examples(examples: Any, segments: Any) -> list:
        chosen = original(examples, segments)
        parents = {segment.parent for segment in segments if segment.parent >= 0}
        roots = [place for place, index in enumerate(i for i, s in enumerate(segments) if s.parent < 0)
                 if index in parents]
        media = [{key: value for key, value in example.items() if key in keys} for example in chosen]
        for first in roots:
            for second in roots:
                if second > first and _swappable(media[first], media[second]):
                    chosen = list(chosen)
                    chosen[first] = {**chosen[first], **media[second]}
                    chosen[second] = {**chosen[second], **media[first]}
                    swapped.append(1)
                    return chosen
        raise AssertionError("image_features_to_another_group: no two shared prompts of this call have media to swap")

    with mock.patch.object(multimodal, "prompt_examples", prompt_examples):
        yield swapped


def _sources_from_siblings(recurrent: bool, conv: bool) -> Any:
    """:func:`~padfree_plugins.modeling.mixers.state_sources` where every completion after the first of its prompt
    continues its previous sibling (its recurrent state if ``recurrent``, its conv taps if ``conv``)."""

    def sources(shared: SharedPrefixes) -> tuple[tuple[int, int], ...]:
        previous: dict[int, int] = {}
        found = []
        for segment, parent in enumerate(shared.parents):
            sibling = previous.get(parent, parent)
            found.append((sibling if recurrent else parent, sibling if conv else parent))
            if parent >= 0:
                previous[parent] = segment
        return tuple(found)

    return sources


@contextmanager
def conv_taps_stop_at_the_parent() -> Iterator[None]:
    """Within the block, a conv tap that reaches back past its segment's parent (a branch point shorter than the
    kernel, in a prefix tree) reads zeros instead of its grandparent's last inputs."""
    original = mixers._conv_context

    def stopping(shared: SharedPrefixes, cu_seq_lens: torch.Tensor, reach: int) -> torch.Tensor:
        context = original(shared, cu_seq_lens, reach)
        bounds = cu_seq_lens.long().tolist()
        for segment, parent in enumerate(shared.parents):
            if parent >= 0:
                inside = min(reach, bounds[parent + 1] - bounds[parent])
                context[segment, :reach - inside] = -1
        return context

    with mock.patch.object(mixers, "_conv_context", stopping):
        yield


@contextmanager
def completions_start_from_zero() -> Iterator[None]:
    """Within the block, every completion of a row with shared prefixes starts its sequence mixers from zeros (no
    recurrent state, no conv taps into its prompt), as a mixer run on the completion alone would."""
    with mock.patch.object(mixers, "state_sources", lambda shared: tuple((-1, -1) for _ in shared.parents)):
        yield


@contextmanager
def completions_continue_a_sibling() -> Iterator[None]:
    """Within the block, every completion after the first of its prompt continues its previous sibling's mixer state
    (recurrent state and conv taps), as a mixer run straight along the row would."""
    with mock.patch.object(mixers, "state_sources", _sources_from_siblings(True, True)):
        yield


@contextmanager
def conv_taps_reach_into_a_sibling() -> Iterator[None]:
    """Within the block, the conv taps of every completion after the first of its prompt read its previous sibling's
    last inputs instead of its prompt's (the recurrent state stays right)."""
    with mock.patch.object(mixers, "state_sources", _sources_from_siblings(False, True)):
        yield


@contextmanager
def tile_drops_last_token() -> Iterator[None]:
    """Within the block, every tile of a tiled feed-forward loses its last token's output (zeros instead), in the
    forward and in the recompute alike. Rows no longer than one tile run untiled and are left alone."""

    original = tiling.run_tile

    def dropping(fn, pieces):
        output = original(fn, pieces)
        dim = 1 if output.ndim == 3 else 0
        if not output.shape[dim]:
            return output  # an empty tile (ZeRO-3 gives every rank as many tiles) has no token to drop
        keep = torch.ones(output.shape[dim], dtype=output.dtype, device=output.device)
        keep[-1] = 0
        return output * keep.reshape([-1] + [1] * (output.ndim - dim - 1))

    with mock.patch.object(tiling, "run_tile", dropping):
        yield


@contextmanager
def held_gather_never_let_go() -> Iterator[None]:
    """Within the block, a tiled feed-forward under DeepSpeed ZeRO-3 never lets go of the parameters it holds
    gathered over its tiles (:class:`~padfree_plugins.modeling.tiling.HeldGathered`): ZeRO's hooks cannot release
    them after the layer's call, so they stay gathered (a leak of the whole layer's weights on every rank)."""
    with mock.patch.object(tiling.HeldGathered, "let_go", lambda self: None):
        yield


@contextmanager
def loss_normalised_per_tile() -> Iterator[None]:
    """Within the block, the tiled loss is the mean over tiles of each tile's mean cross-entropy, instead of the
    row's summed cross-entropy divided once (by ``num_items_in_batch`` or the row's label count)."""

    def per_tile(sums, counts, divisor):
        return torch.stack([s / c for s, c in zip(sums, counts) if c > 0]).mean()

    with mock.patch.object(tiling, "normalised", per_tile):
        yield


@contextmanager
def mixer_tile_starts_from_zero() -> Iterator[None]:
    """Within the block, a tiled sequence mixer's piece of an example after a tile cut starts from zeros (no recurrent
    state, no conv taps from the previous tile), in the forward and in the recompute alike, as a mixer scanning each
    tile alone would."""

    def zeros(received: mixers.MixerState) -> mixers.MixerState:
        return mixers.MixerState(final_conv=_times_zero(received.final_conv),
                                 final_recurrent=_times_zero(received.final_recurrent), lead=received.lead)

    with mock.patch.object(tiled_mixers, "tile_start", zeros):
        yield


@contextmanager
def mixer_recompute_takes_any_stash() -> Iterator[None]:
    """Within the block, a tiled sequence mixer's checkpoint recompute takes the output kept by any live scan of the
    same tiles (the oldest first), its input not compared."""

    def same_tiles(stash: Any, plans: Any, printed: torch.Tensor) -> bool:
        return stash.plans == plans

    with mock.patch.object(tiled_mixers, "same_input", same_tiles):
        yield


@contextmanager
def pooling_reads_local_slice() -> Iterator[None]:
    """Within the block, a pooled task under sequence parallelism (``SequenceParallelForward.pooled``: seq_cls,
    embedding, reranker) pools from this rank's own slice of the group's row alone: its micro-batch's hidden states
    where its slice holds them, zeros where another rank's slice does (the exchange left out). An example that crosses
    the cut, or lies in another rank's slice, is pooled wrongly."""

    def local_only(self: SequenceParallelForward, hidden: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        rank, size, local = self.group.rank, self.group.size, hidden.shape[1]
        before = hidden.new_zeros((1, rank * local, *hidden.shape[2:]))
        after = hidden.new_zeros((1, (size - rank - 1) * local, *hidden.shape[2:]))
        return torch.cat([before, hidden, after], dim=1).narrow(1, sum(sizes[:rank]), sizes[rank])

    with mock.patch.object(SequenceParallelForward, "own_hidden", local_only):
        yield


@contextmanager
def context_keys_from_own_slice_only() -> Iterator[None]:
    """Within the block, all-gather sequence parallelism lets each rank's queries see only the keys of its own slice:
    an example crossing the slice's start loses its earlier keys (as if the slice were a row of its own)."""

    def own(cu_seq_lens, start, local, causal):
        return (cu_seq_lens - start).clamp(0, local), cu_seq_lens.clamp(start, start + local), start + local

    with mock.patch.object(context_parallel, "slice_boundaries", own):
        yield


@contextmanager
def context_queries_one_token_ahead() -> Iterator[None]:
    """Within the block, all-gather sequence parallelism places each query one token off (causal): an example
    crossing the end of a rank's slice gets one key more, so each of its queries there sees the next token."""
    right = context_parallel.slice_boundaries

    def ahead(cu_seq_lens, start, local, causal):
        queries, keys, seen = right(cu_seq_lens, start, local, causal)
        if seen is None:
            return queries, keys, seen
        return queries, cu_seq_lens.clamp(max=seen + 1), seen + 1

    with mock.patch.object(context_parallel, "slice_boundaries", ahead):
        yield


@contextmanager
def zigzag_chunks_masked_as_one_run() -> Iterator[None]:
    """Balanced all-gather attention masks each rank's exchanged queries as one contiguous run from its first chunk:
    the second chunk's queries (later in the row) are aligned to the keys right after the first chunk."""
    right = context_parallel.AllGatherAttention.attend

    def misaligned(self, module, query, key, value, attention_mask, causal, start=None, **kwargs):
        if start is not None:
            zigzag = context_parallel.Zigzag.of(kwargs["cu_seq_lens_q"], self.group.size)
            (_, first_end), (second, _) = zigzag.spans(self.group.rank)
            start = first_end if start == second else start
        return right(self, module, query, key, value, attention_mask, causal, start=start, **kwargs)

    with mock.patch.object(context_parallel.AllGatherAttention, "attend", misaligned):
        yield


@contextmanager
def zigzag_outputs_to_wrong_rank() -> Iterator[None]:
    """Balanced all-gather attention sends each rank's two chunks of outputs back swapped: each block of outputs
    reaches the rank that owns the other chunk's tokens (same sizes, so nothing hangs)."""
    right = context_parallel.return_outputs

    def swapped(out, route):
        half = out.shape[1] // 2
        return right(torch.cat([out[:, half:], out[:, :half]], 1), route)

    with mock.patch.object(context_parallel, "return_outputs", swapped):
        yield


def _times_zero(state: torch.Tensor | None) -> torch.Tensor | None:
    return None if state is None else state * 0


@contextmanager
def mixer_scans_only_its_slice() -> Iterator[None]:
    """Within the block, a split sequence mixer's piece of an example after a cut starts from zeros (no recurrent
    state, no conv taps from the previous rank), as a mixer scanning its rank's slice alone would. The exchange still
    runs (its gradient is zero), so that the ranks stay in step."""

    def zeros(received: mixers.MixerState, own: mixers.MixerState | None) -> mixers.MixerState:
        return mixers.MixerState(final_conv=_times_zero(received.final_conv),
                                 final_recurrent=_times_zero(received.final_recurrent))

    with mock.patch.object(split_mixers, "continuation", zeros):
        yield


@contextmanager
def state_from_wrong_rank() -> Iterator[None]:
    """Within the block, a split sequence mixer's piece of an example after a cut starts from the final state of this
    rank's own slice (its last segment's: the state it would send on, as if rank ``r`` were its own previous rank),
    not from rank ``r-1``'s; zeros where the slice holds nothing else. The exchange still runs."""

    def own_state(received: mixers.MixerState, own: mixers.MixerState | None) -> mixers.MixerState:
        def pick(mine: torch.Tensor | None, theirs: torch.Tensor | None) -> torch.Tensor | None:
            if theirs is None:
                return None
            return theirs * 0 if mine is None else mine.to(theirs.dtype) + theirs * 0

        own = own or mixers.MixerState()
        return mixers.MixerState(final_conv=pick(own.final_conv, received.final_conv),
                                 final_recurrent=pick(own.final_recurrent, received.final_recurrent))

    right = split_mixers.slice_plan

    def keeping_the_last(*args: Any, **kwargs: Any) -> split_mixers.SlicePlan:
        plan = right(*args, **kwargs)
        return replace(plan, read=plan.read | {len(plan.bounds) - 2})

    with mock.patch.object(split_mixers, "continuation", own_state), \
            mock.patch.object(split_mixers, "slice_plan", keeping_the_last):
        yield


@contextmanager
def child_starts_from_rank_predecessor() -> Iterator[None]:
    """Within the block, a segment of a shared row whose parent ended on an earlier rank than its own start (a
    completion on rank ``r``, its prompt on rank ``r-1`` or before) starts from the last state rank ``r-1`` handed
    on — the piece cut by the boundary, else the latest segment to end there — not from its parent's: as if only one
    state (the predecessor's) crossed each cut. Where that is its parent's, nothing changes. The exchange still
    runs."""

    def predecessor(received: dict, key: Any) -> mixers.MixerState:
        latest = split_mixers.PREVIOUS_RANK if split_mixers.PREVIOUS_RANK in received else max(
            (name for name in received if name != split_mixers.PREVIOUS_RANK), key=lambda name: name[1])
        wrong, right = received[latest], received[key]

        def pick(mine: torch.Tensor | None, theirs: torch.Tensor | None) -> torch.Tensor | None:
            if theirs is None or mine is None or mine.shape != theirs.shape:
                return theirs
            return mine + theirs * 0

        return mixers.MixerState(final_conv=pick(wrong.final_conv, right.final_conv),
                                 final_recurrent=pick(wrong.final_recurrent, right.final_recurrent), lead=wrong.lead)

    with mock.patch.object(split_mixers, "ended_earlier", predecessor):
        yield


@contextmanager
def parent_keys_not_exchanged() -> Iterator[None]:
    """Within the block, under sequence parallelism with one group of every process, a segment of a shared row sees
    zeros for the keys and values of its ancestors' tokens that lie in another rank's slice of the row: as if each rank
    applied the shared structure to its own slice, the parent keys and values of a completion across the cut never
    exchanged (under all-gather attention: those keys left out of the segment's keys). Rows whose prompts and
    completions sit in one slice are unchanged."""
    import torch.distributed as dist

    right = attention._shared_keys

    def local(module, backend, shared, key, value, causal, blocks):
        total = key.shape[0]
        key, value, cu_k, longest = right(module, backend, shared, key, value, causal, blocks)
        size, rank = dist.get_world_size(), dist.get_rank()
        bounds = shared.cu_seq_lens_k.long().cpu()
        counts = bounds.diff()
        lengths = torch.tensor([int(count) - (int(counts[parent]) if parent >= 0 else 0)
                                for count, parent in zip(counts, shared.parents)])
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        index = shared.key_index.cpu()
        ancestor = index < torch.repeat_interleave(starts, counts)
        elsewhere = index // (total // size) != rank
        keep = (~(ancestor & elsewhere)).to(key.device, key.dtype)[:, None, None]
        return key * keep, value * keep, cu_k, longest

    right_slice = SharedPrefixes.slice_keys

    def local_slice(self: SharedPrefixes, start: int, end: int):  # all-gather: ancestors outside the slice dropped
        index, bounds, _ = right_slice(self, start, end)
        counts = self.cu_seq_lens_k.long().diff().tolist()
        pieces, edges = [], bounds.long().tolist()
        for segment, parent in enumerate(self.parents):
            piece = index[edges[segment]:edges[segment + 1]]
            ancestors = min(counts[parent] if parent >= 0 else 0, piece.numel())
            head = piece[:ancestors]
            pieces.append(torch.cat([head[(head >= start) & (head < end)], piece[ancestors:]]))
        sizes = torch.tensor([piece.numel() for piece in pieces])
        cu = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).to(torch.int32)
        return torch.cat(pieces), cu.to(bounds.device), int(sizes.max())

    with mock.patch.object(attention, "_shared_keys", local), \
            mock.patch.object(SharedPrefixes, "slice_keys", local_slice):
        yield


@contextmanager
def image_features_sliced_off_by_one() -> Iterator[None]:
    """Within the block, an image-text row under sequence parallelism (:class:`~padfree_plugins.modeling.
    sequence_parallel.SliceRow`) hands every rank after the first the merged embeddings one token early: each token of
    its slice gets the embedding (an image feature, or text) of the token before it, with its own position. An image
    cut by a rank boundary loses its first feature on the later rank."""
    right = SliceRow.__call__

    def early(self: SliceRow, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        answer = right(self, module, args, kwargs)
        if answer is None or self.group.rank == 0:
            return answer
        whole = kwargs["inputs_embeds"]
        cut = self.group.slice_of(whole.shape[1])
        answer[1]["inputs_embeds"] = whole[:, cut.start - 1:cut.stop - 1]
        return answer

    with mock.patch.object(SliceRow, "__call__", early):
        yield


@contextmanager
def tower_gradients_not_summed() -> Iterator[None]:
    """Within the block, the backward of the image features gathered over a sequence-parallel group
    (:class:`~padfree_plugins.modeling.tower_share.TowerShare`) does not sum their gradient over the group: each rank's
    tower gets only what its own slice of the row sends its images' features (an image whose tokens lie in another
    rank's slice gets nothing from there). The forward is untouched."""
    with mock.patch.object(tower_share, "sum_over_group", lambda grad, group: grad):
        yield


@contextmanager
def dummy_calls_untied() -> Iterator[None]:
    """Within the block, a mixer's calls on zeros that match another rank's number of calls under ZeRO-3
    (:func:`~padfree_plugins.modeling.mixers.equal_calls`) add a zero that is not tied to their output: the forward
    makes every call, the backward skips them."""

    def untied(output: torch.Tensor) -> torch.Tensor:
        return output.new_zeros(())

    with mock.patch.object(mixers, "tie_in", untied):
        yield
