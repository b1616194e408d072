#!/usr/bin/env bash
# Here (not on the device): unpack the parts train_heads.sh wrote and put the heads where the
# plugins ship them. Usage: bash scripts/device/install_heads.sh DIR_WITH_PARTS [UNPACK_DIR]
# The training reports, logs and curves stay in UNPACK_DIR (default /tmp/tr_h200); plot with
#   python -m speculum.train.curves --from-json UNPACK_DIR/curves.json --plot docs/results/h200/plots/training_curves.png
set -euo pipefail
PARTS=${1:?directory with heads.tar.part_*}
DST=${2:-/tmp/tr_h200}
cd "$(dirname "$0")/../.."
mkdir -p "$DST"
cat "$PARTS"/heads.tar.part_* | tar x -C "$DST"
N=smollm2-135m-instruct
install() {  # method plugin-package [folder: heads, or drafts for the draft model]
  local src="$DST/$1" dst="plugins/$2/${3:-heads}/$1-$N"
  [ -d "$src" ] || { echo "$1: not in this run (METHODS=...): the shipped head stays"; return 0; }
  mkdir -p "$dst"
  rm -f "$dst"/*
  cp "$src"/config.json "$dst"/
  cp "$src"/*.safetensors "$dst"/
  echo "installed $dst ($(du -sh "$dst" | cut -f1))"
}
install eagle speculum-eagle/speculum_eagle
install eagle3 speculum-eagle/speculum_eagle
install medusa speculum-medusa/speculum_medusa
install mtp speculum-mtp/speculum_mtp
# the draft saved without the target's embedding (--embeddings-from-target: 14 MB for two layers)
install draft speculum-draft-model/speculum_draft_model drafts
