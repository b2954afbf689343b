#!/usr/bin/env bash
# Regenerates docs/examples/smollm2-ladder/: the model card (README.md + plot) `quantkit push` would write for
# a GGUF ladder of the demo model, each file measured against the original (wikitext-2 test, 8 × 512 tokens).
#   bash docs/examples/make-smollm2-ladder.sh        (from the project root; a few minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK="${WORK:-$(mktemp -d)}"
DATA=../shared/data/wikitext2-test.raw.txt
TYPES=(Q2_K Q3_K_M Q4_K_M Q5_K_M Q6_K Q8_0)
# converted from inside $WORK, so the command the card shows reads `-o ladder` rather than a temporary path
(cd "$WORK" && quantkit convert demo:smollm2-135m $(printf -- '-f gguf:%s ' "${TYPES[@]}") -o ladder)
for t in "${TYPES[@]}"; do
  quantkit eval "$WORK/ladder/smollm2-135m-$t.gguf" --base demo:smollm2-135m --data "$DATA" --ctx 512 --windows 8 --record
done
quantkit card $(printf -- "$WORK/ladder/smollm2-135m-%s.gguf " "${TYPES[@]}") --repo quantkit-demo/SmolLM2-135M-Instruct-GGUF \
  -o docs/examples/smollm2-ladder
