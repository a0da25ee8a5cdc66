#!/usr/bin/env bash
# Seconds from `make serve` on a fresh clone of this checkout to the first answer about the
# demo's example image (the figure in the README's quick start). Uses port 8000.
set -euo pipefail
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=$(mktemp -d)
git clone -q "$repo" "$work/mm_serve" && cd "$work/mm_serve"
start=$(date +%s.%N)
setsid make serve >"$work/serve.log" 2>&1 &
trap 'kill -- -$(pgrep -f "make serve" | head -1) 2>/dev/null; rm -rf "$work"' EXIT
until curl -sf http://127.0.0.1:8000/health >/dev/null; do sleep 0.5; done
up=$(date +%s.%N)
image=$(base64 -w0 samples/demo_vlm/example.png)
curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{
  "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,'"$image"'"}},
    {"type": "text", "text": "Describe the image."}]}], "max_tokens": 64}' |
  python3 -c "import json, sys; print(json.load(sys.stdin)['choices'][0]['message']['content'])"
done=$(date +%s.%N)
echo "server up after $(echo "$up - $start" | bc) s; first answer after $(echo "$done - $start" | bc) s"
