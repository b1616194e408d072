#!/usr/bin/env bash
# On the device: copy the shipped heads this call carried into $H (default /tmp/h), one folder per
# method (eagle3, eagle, medusa, mtp, draft), for `HEADS=/tmp/h bash scripts/device/bench_heads.sh`.
# Why: the shipped heads and draft (about 72 MB) no longer fit one call beside the tree (64 MiB in
# all), and a folder carried by one call is gone from the working tree in the next, while /tmp
# stays as long as the machine is warm. So two calls each carry some heads and stage them here:
#   carry plugins/speculum-eagle/speculum_eagle/heads plugins/speculum-mtp/speculum_mtp/heads:  bash scripts/device/stage_heads.sh
#   carry plugins/speculum-medusa/speculum_medusa/heads plugins/speculum-draft-model/speculum_draft_model/drafts:
#     bash scripts/device/stage_heads.sh && HEADS=/tmp/h TESTS=0 bash scripts/device/bench_heads.sh
set -e
H=${H:-/tmp/h}
mkdir -p "$H"
for d in plugins/*/speculum_*/heads/*/ plugins/*/speculum_*/drafts/*/; do
  [ -f "$d/config.json" ] || continue
  n=$(basename "$d")           # <method>-<target>, e.g. eagle3-smollm2-135m-instruct
  rm -rf "${H:?}/${n%%-*}" && cp -r "$d" "$H/${n%%-*}"
done
for m in "$H"/*/; do echo "staged $(basename "$m"): $(du -sh "$m" | cut -f1)"; done
