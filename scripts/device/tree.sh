#!/usr/bin/env bash
# Here, not on the device: what the working tree of a device call carries. The tree travels
# with every call and a call carries 64 MiB in all, so the large tracked folders are
# untracked (and ignored) for the calls that carry a GGUF half, and tracked again after.
#
#   bash scripts/device/tree.sh small    # heads, docs/results and the n-gram corpora out: the tree
#                                        # is ~6 MB, room for .whl + .gguf_a or .gguf_b (47 MiB each)
#   bash scripts/device/tree.sh heads    # the shipped heads back in (~72 MB since the draft shipped:
#                                        # more than a call carries; it says so). Carry the heads a
#                                        # call needs instead, or stage them all in /tmp over two
#                                        # calls: scripts/device/stage_heads.sh
#   bash scripts/device/tree.sh restore  # everything back (before any commit)
#   bash scripts/device/tree.sh size     # bytes the tree carries now
set -e -f  # -f: the patterns below stay patterns (the ignore lines); compgen -G expands them
cd "$(git rev-parse --show-toplevel)"
EX=.git/info/exclude
# the shipped heads and drafts (drafts/: the draft-model plugin's, once one ships)
HEADS='plugins/*/speculum_*/heads plugins/*/speculum_*/drafts'
OTHERS='docs/results plugins/speculum-ngram/speculum_ngram/corpora'

untrack() {  # $@: paths (globs expanded here; one that matches nothing is left alone)
  for p in "$@"; do
    compgen -G "$p" > /dev/null || continue
    compgen -G "$p" | xargs git rm -r -q --cached --ignore-unmatch
    grep -qxF "/$p/" $EX 2>/dev/null || echo "/$p/" >> $EX
  done
}
track() {
  for p in "$@"; do
    if [ -f $EX ]; then grep -vxF "/$p/" $EX > $EX.tmp || true; mv $EX.tmp $EX; fi
    compgen -G "$p" > /dev/null && compgen -G "$p" | xargs git add
  done
  return 0
}
size() { git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {printf "the tree carries %.1f MB\n", s / 1e6
  if (s > 67108864) print "more than a device call carries (64 MiB): carry the heads a call needs, or stage them (stage_heads.sh)"}'; }

case "${1:-size}" in
  small) untrack $HEADS $OTHERS ;;
  heads) untrack $OTHERS; track $HEADS ;;
  restore) track $HEADS $OTHERS ;;
  size) ;;
  *) echo "usage: bash scripts/device/tree.sh small|heads|restore|size" >&2; exit 2 ;;
esac
size
