"""Token trees: a step's draft as a tree per sequence, verified in one target forward.

A :class:`TokenTree` rides on a :class:`~speculum.interfaces.Draft`: node ``i`` of row
``b`` carries the token ``draft.token_ids[b, i]`` and a parent ``parents[b, i]``, where
``-1`` is the root (the sequence's last committed token, column 0 of the verify
forward) and any other value is an earlier node (``parents[b, i] < i``). A chain of
``k`` drafts is the tree ``parents = [-1, 0, 1, ..., k - 2]``; a draft without a tree
is read as that chain, so proposers that draft chains need no change.

The verify forward sees ``[root, node 0, ..., node N-1]``: column ``c`` is node
``c - 1``; its position is the root's plus its depth, and it attends to the committed
context, the root and its own ancestors only.

:class:`TreeSpec` is the tree a proposer is asked to draft, from the speculative
config: a static tree (``speculative_token_tree``, lists of top-k ranks, the Medusa
``medusa_choices`` form that vLLM also reads) or a dynamic EAGLE-2 tree (``tree_topk``,
``tree_depth``, ``num_draft_tokens`` with SGLang's meaning). See docs/trees.md.
"""

from __future__ import annotations

import ast
import math
from typing import Any, Protocol, Sequence, runtime_checkable

import attrs
import torch

from speculum.errors import ConfigError

Path = tuple[int, ...]


# --------------------------------------------------------------------------- tensor ops
def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] parents (-1 = root) -> [B, N, N] bool: ``a[b, i, j]`` iff node j is node i
    or one of its ancestors. Pointer doubling: ceil(log2 N) rounds of row gathers."""
    B, N = parents.shape
    idx = torch.arange(N, device=parents.device)
    jump = torch.where(parents >= 0, parents, idx)  # [B, N]: a node's parent (a root's child: itself)
    a = (idx.view(1, N, 1) == idx.view(1, 1, N)) | (jump.unsqueeze(-1) == idx.view(1, 1, N))
    for _ in range(max(0, math.ceil(math.log2(max(N, 1))))):
        # a[i] covers i's 2^t nearest ancestors and jump[i] is the 2^t-th: add jump[i]'s
        # (row gathers, no matrix product: a handful of small kernels inside a CUDA graph)
        a = a | a.gather(1, jump.unsqueeze(-1).expand(B, N, N))
        jump = jump.gather(1, jump)
    return a


def column_tree(tree: "TokenTree", q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per verify column (root first, ``q >= N + 1``): depth [B, q] (root 0) and column
    visibility [B, q, q] bool (``vis[b, c, c']``: column c attends to column c')."""
    return columns_of(tree.depth, tree.ancestors, q)


def columns_of(depth: torch.Tensor, ancestors: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`column_tree` from node depths [B, N] and ancestors [B, N, N] (static shapes:
    runs inside a CUDA graph)."""
    B, N, _ = ancestors.shape
    vis = torch.zeros(B, q, q, dtype=torch.bool, device=ancestors.device)
    vis[:, :, 0] = True
    vis[:, 1: N + 1, 1: N + 1] = ancestors
    cdepth = torch.zeros(B, q, dtype=torch.int64, device=ancestors.device)
    cdepth[:, 1: N + 1] = depth
    if q > N + 1:  # padding columns: see themselves only (no indexed write: graph-capture safe)
        cols = torch.arange(q, device=ancestors.device)
        vis |= torch.diag_embed(cols >= N + 1).unsqueeze(0)
    return cdepth, vis


def tree_attention_mask(num_keys: int, base: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    """Attention mask [B, 1, q, num_keys] of a tree forward over a flat context.

    Key ``j`` holds logical position ``j``; ``base`` [B] is where the tree's keys start
    (keys before it are committed context, visible to every query); key ``base + c``
    (``0 <= c < K``) is visible to query ``i`` iff ``vis[b, i, c]`` ([B, q, K]); keys past
    the tree are hidden."""
    B, q, K = vis.shape
    rel = torch.arange(num_keys, device=vis.device).view(1, num_keys) - base.view(B, 1)  # [B, Lc]
    inside = (rel >= 0) & (rel < K)
    seen = vis.gather(2, rel.clamp(0, K - 1).unsqueeze(1).expand(B, q, num_keys))  # [B, q, Lc]
    return ((rel < 0).unsqueeze(1) | (inside.unsqueeze(1) & seen)).unsqueeze(1)


@attrs.frozen(eq=False)
class TreeMask:
    """A tree forward's attention, compact: what :func:`tree_attention_mask` spells out
    over every key, kept as the tree part alone. Keys before ``base`` [B] are committed
    context (visible to every query); key ``base + c`` (``0 <= c < K``) is visible to
    query ``i`` iff ``vis[b, i, c]`` ([B, q, K] bool); keys past the tree are hidden. The
    paged Triton attention reads it as it is (no [B, q, Lc] mask built and read in every
    layer); other attention paths take :meth:`dense`."""

    base: torch.Tensor
    vis: torch.Tensor

    def dense(self, num_keys: int) -> torch.Tensor:
        """[B, 1, q, num_keys] bool, True = attend."""
        return tree_attention_mask(num_keys, self.base, self.vis)


# ------------------------------------------------------------------------------ the type
@attrs.define(eq=False)
class TokenTree:
    """The tree shape of a draft (see the module doc); tokens stay in ``Draft.token_ids``.

    ``depth`` and ``ancestors`` are derived from ``parents`` on first use unless the
    proposer gives them. ``max_depth`` and ``max_children`` are host-side bounds (any
    node's depth, any node's number of children) that let the verifier loop a fixed
    number of times without reading the device; None = the node count. Padding nodes
    (token -1: never accepted, never tried) do not count as children, so a tree padded
    to its fixed node count under the root keeps the bound of its real nodes (the
    sampled verifier loops ``max_depth x max_children`` times).
    """

    # [B, N] int64: parent node index, -1 = the root; parents[b, i] < i
    parents: torch.Tensor
    # [B, N] int64: children of the root have depth 1
    _depth: torch.Tensor | None = attrs.field(default=None, alias="depth")
    # [B, N, N] bool: ancestors[b, i, j] iff node j is on the path from the root to node i
    _ancestors: torch.Tensor | None = attrs.field(default=None, alias="ancestors")
    max_depth: int | None = None
    max_children: int | None = None

    @property
    def ancestors(self) -> torch.Tensor:
        if self._ancestors is None:
            self._ancestors = tree_ancestors(self.parents)
        return self._ancestors

    @property
    def depth(self) -> torch.Tensor:
        if self._depth is None:
            self._depth = self.ancestors.sum(-1)
        return self._depth

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[1])

    @property
    def depth_bound(self) -> int:
        return self.max_depth if self.max_depth is not None else self.num_nodes

    @property
    def children_bound(self) -> int:
        return self.max_children if self.max_children is not None else self.num_nodes

    @classmethod
    def chain(cls, batch_size: int, k: int, device: torch.device | str = "cpu") -> "TokenTree":
        """The chain of ``k`` drafts as a tree."""
        parents = (torch.arange(k, device=device) - 1).expand(batch_size, k).contiguous()
        return cls(parents, max_depth=k, max_children=1)

    def check(self, token_ids: torch.Tensor) -> None:
        """Shape and dtype contract (no device reads): raises TypeError/ValueError."""
        p = self.parents
        if not isinstance(p, torch.Tensor) or p.dtype != torch.int64 or p.dim() != 2:
            raise TypeError(f"TokenTree.parents must be an int64 tensor [B, N], got "
                            f"{getattr(p, 'dtype', type(p))} {tuple(getattr(p, 'shape', ()))}")
        if tuple(p.shape) != tuple(token_ids.shape):
            raise ValueError(f"TokenTree.parents has shape {tuple(p.shape)} but the draft's token_ids "
                             f"{tuple(token_ids.shape)}: one parent per node")
        if p.device != token_ids.device:
            raise ValueError(f"TokenTree.parents is on {p.device}, the draft's tokens on {token_ids.device}")
        for name, t, shape in (("depth", self._depth, tuple(p.shape)),
                               ("ancestors", self._ancestors, (*p.shape, p.shape[1]))):
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"TokenTree.{name} has shape {tuple(t.shape)}, expected {shape}")

    def validate(self, token_ids: torch.Tensor | None = None) -> None:
        """Full check of the structure (reads the device; for tests and debugging). With the
        draft's ``token_ids``, padding nodes (token -1) are left out of ``max_children``."""
        p = self.parents
        idx = torch.arange(p.shape[1], device=p.device).view(1, -1)
        if bool(((p < -1) | (p >= idx)).any()):
            raise ValueError("every parent must be -1 (the root) or an earlier node's index")
        d = self.depth
        if self.max_depth is not None and p.numel() and int(d.max()) > self.max_depth:
            raise ValueError(f"a node has depth {int(d.max())} > max_depth {self.max_depth}")
        if self.max_children is not None and p.numel():
            counts = torch.zeros(p.shape[0], p.shape[1] + 1, dtype=torch.int64, device=p.device)
            real = torch.ones_like(p) if token_ids is None else (token_ids.to(p.device) >= 0).to(torch.int64)
            counts.scatter_add_(1, p + 1, real)
            if int(counts.max()) > self.max_children:
                raise ValueError(f"a node has {int(counts.max())} children > max_children {self.max_children}")

    def index(self, rows: torch.Tensor) -> "TokenTree":
        """The trees of the given rows (a [R] index or bool mask)."""
        pick = (lambda t: None if t is None else t[rows])
        return TokenTree(self.parents[rows], depth=pick(self._depth), ancestors=pick(self._ancestors),
                         max_depth=self.max_depth, max_children=self.max_children)


# ----------------------------------------------------------------------- the configured tree
def parse_paths(value: Any) -> tuple[Path, ...]:
    """``speculative_token_tree`` as given (a list of lists/tuples, or their string) ->
    paths sorted breadth first (by length, then by ranks), as vLLM sorts them."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError) as exc:
            raise ConfigError(f"speculative_token_tree must be a list of paths like [[0], [1], [0, 0]], "
                              f"got the string {value!r} ({exc})") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"speculative_token_tree must be a non-empty list of paths (lists of top-k ranks), "
                          f"e.g. [[0], [1], [0, 0]]; got {value!r}")
    paths = []
    for p in value:
        if (not isinstance(p, (list, tuple)) or not p
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)):
            raise ConfigError(f"speculative_token_tree: every path is a non-empty list of ranks >= 0 "
                              f"(0 = the top-1 child), got {p!r}")
        paths.append(tuple(p))
    paths = sorted(set(paths), key=lambda t: (len(t), t))
    if len(paths) != len(value):
        raise ConfigError("speculative_token_tree lists a path twice")
    have = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in have:
            raise ConfigError(f"speculative_token_tree: path {list(p)} needs its parent {list(p[:-1])} too")
    return tuple(paths)


@attrs.frozen
class TreeSpec:
    """The tree drafted each step: static ``paths``, or dynamic (``topk`` set).

    ``num_nodes``: draft tokens per step (the root not counted), ``depth``: the longest
    path. A dynamic tree expands the ``topk`` best children of the ``topk`` best nodes by
    cumulative draft log-probability ``depth`` times, then keeps the best ``num_nodes``
    of all candidates (EAGLE-2).
    """

    num_nodes: int
    depth: int
    topk: int | None = None
    paths: tuple[Path, ...] | None = None

    @classmethod
    def static(cls, value: Any) -> "TreeSpec":
        paths = parse_paths(value)
        return cls(num_nodes=len(paths), depth=max(len(p) for p in paths), paths=paths)

    @classmethod
    def dynamic(cls, topk: int, depth: int, num_draft_tokens: int) -> "TreeSpec":
        """SGLang's meaning: ``num_draft_tokens`` counts the root (the verified token)."""
        for name, v, lo in (("tree_topk", topk, 1), ("tree_depth", depth, 1), ("num_draft_tokens", num_draft_tokens, 2)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
        most = topk + (depth - 1) * topk * topk
        if num_draft_tokens - 1 > most:
            raise ConfigError(
                f"num_draft_tokens={num_draft_tokens} asks for {num_draft_tokens - 1} draft nodes, but a tree of "
                f"tree_topk={topk} and tree_depth={depth} has at most {most} candidates; lower num_draft_tokens "
                "or raise tree_topk / tree_depth")
        return cls(num_nodes=num_draft_tokens - 1, depth=depth, topk=topk)

    @property
    def is_static(self) -> bool:
        return self.paths is not None

    @property
    def num_draft_tokens(self) -> int:
        """Tokens the target verifies per step: the nodes and the root."""
        return self.num_nodes + 1

    # -- static structure ----------------------------------------------------------------
    def static_parents(self) -> list[int]:
        """Parent node index of each static node (-1 = root), breadth-first order."""
        where = {p: i for i, p in enumerate(self.paths)}
        return [where[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    def static_levels(self) -> list[list[int]]:
        """Node indices per depth (index 0 = depth 1)."""
        levels: list[list[int]] = [[] for _ in range(self.depth)]
        for i, p in enumerate(self.paths):
            levels[len(p) - 1].append(i)
        return levels

    @property
    def max_children(self) -> int:
        if self.topk is not None:
            return self.topk
        counts: dict[int, int] = {}
        for par in self.static_parents():
            counts[par] = counts.get(par, 0) + 1
        return max(counts.values())

    def describe(self) -> str:
        if self.is_static:
            return f"static tree of {self.num_nodes} nodes, depth {self.depth}"
        return f"dynamic tree: top-{self.topk}, depth {self.depth}, {self.num_nodes} nodes"

    def label(self) -> str:
        """Short name for tables, e.g. ``tree4x5/16`` or ``static12``."""
        if self.is_static:
            return f"static{self.num_nodes}"
        return f"tree{self.topk}x{self.depth}/{self.num_draft_tokens}"


def tree_from_config(speculative_token_tree: Any = None, tree_topk: int | None = None,
                     tree_depth: int | None = None, num_draft_tokens: int | None = None,
                     num_speculative_tokens: int | None = None) -> TreeSpec | None:
    """The :class:`TreeSpec` of a speculative config's keys (None: chain drafting).

    ``num_speculative_tokens``, when given with a tree, must equal its number of nodes
    (vLLM's rule for ``speculative_token_tree``)."""
    dynamic = {"tree_topk": tree_topk, "tree_depth": tree_depth, "num_draft_tokens": num_draft_tokens}
    given = [k for k, v in dynamic.items() if v is not None]
    if speculative_token_tree is not None and given:
        raise ConfigError(f"give either speculative_token_tree (a static tree) or tree_topk, tree_depth and "
                          f"num_draft_tokens (a dynamic tree), not both (got {', '.join(given)} too)")
    if speculative_token_tree is not None:
        spec = TreeSpec.static(speculative_token_tree)
    elif given:
        missing = [k for k, v in dynamic.items() if v is None]
        if missing:
            raise ConfigError(f"a dynamic tree needs tree_topk, tree_depth and num_draft_tokens; missing "
                              f"{', '.join(missing)} (e.g. {{\"tree_topk\": 4, \"tree_depth\": 5, "
                              "\"num_draft_tokens\": 16})")
        spec = TreeSpec.dynamic(tree_topk, tree_depth, num_draft_tokens)
    else:
        return None
    if num_speculative_tokens is not None and num_speculative_tokens != spec.num_nodes:
        raise ConfigError(f"num_speculative_tokens={num_speculative_tokens}, but the {spec.describe()} has "
                          f"{spec.num_nodes} draft tokens; leave num_speculative_tokens out or set it to "
                          f"{spec.num_nodes}")
    return spec


# ------------------------------------------------------------------ helpers of the loop
def path_moves(path: Sequence[int], num_accepted: int, root_position: int) -> tuple[list[int], list[int]]:
    """Logical positions (source, destination) that put an accepted path's K/V in order.

    Node ``i`` of a tree step was written at ``root_position + 1 + i``; the node at depth
    ``d`` belongs at ``root_position + d``. Nodes already in place are left out."""
    src, dst = [], []
    for d, node in enumerate(path[:num_accepted], start=1):
        if node + 1 != d:
            src.append(root_position + 1 + node)
            dst.append(root_position + d)
    return src, dst


def gather_path(hidden: dict[int, torch.Tensor], path: torch.Tensor) -> dict[int, torch.Tensor]:
    """Verify-step hidden states {layer: [B, N+1, H]} (columns) -> in path order: row ``b``
    holds the root's state, then the accepted nodes' (later rows are the root's again)."""
    any_h = next(iter(hidden.values()))
    # [B, N+1]: column 0 (the root), then each accepted node's column; -1 padding reads column 0
    cols = torch.nn.functional.pad(path.to(any_h.device) + 1, (1, 0))
    index: dict[tuple[int, int], torch.Tensor] = {}  # one index per (columns, width), shared by the layers
    out = {}
    for l, h in hidden.items():
        key = (h.shape[1], h.shape[-1])
        if key not in index:
            index[key] = cols[:, : key[0]].unsqueeze(-1).expand(-1, -1, key[1])
        out[l] = h.gather(1, index[key])
    return out


@runtime_checkable
class TreeProposer(Protocol):
    """A proposer that drafts token trees when the speculative config asks for one."""

    supports_trees: bool
    #: positions its own KV cache may append per sequence in one step beyond the sequence
    #: (a draft head's tree region); the engine reserves at least this many in every cache
    kv_lookahead: int


def check_tree_support(spec: TreeSpec, method: str, proposer: Any, verifier: Any, verifier_name: str,
                       target: Any) -> None:
    """ConfigError unless the proposer, the verifier and the target runner handle trees."""
    for what, obj, fix in (
            (f"method {method!r}", proposer, "use a method that drafts trees (eagle, eagle3, mtp, medusa, ngram) or drop "
                                             "the tree keys"),
            (f"verifier {verifier_name!r}", verifier, "use acceptance_method 'rejection_sampler', 'greedy' or "
                                                      "'exact_match'"),
            (f"the {type(target).__name__} runner", target, "use the torch backend's native or hf runner")):
        if not getattr(obj, "supports_trees", False):
            fix = getattr(obj, "tree_fix", None) or fix  # an object may say why and what to do
            raise ConfigError(f"the speculative config asks for a {spec.describe()}, but {what} does not "
                              f"handle token trees; {fix}")
