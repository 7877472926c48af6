#!/usr/bin/env bash
# Re-take the README's Prefect UI screenshots: a 4-step `tidal run tiny-cpu` into a scratch
# PREFECT_HOME, a Prefect server with its UI on that home, then headless Chromium on four pages.
# Needs `chromium` (Debian: apt-get install chromium). Usage: docs/ui/take_screenshots.sh [PORT]
set -euo pipefail
cd "$(dirname "$0")/../.."
port=${1:-4399}
work=$(mktemp -d /tmp/tidal-shots-XXXX)
export PREFECT_HOME=$work/home PREFECT_SERVER_ANALYTICS_ENABLED=false
.venv/bin/tidal run tiny-cpu --set trainer.total_training_steps=4 --set storage.url=sqlite:///$work/tidal.db \
  --set trainer.default_local_dir=$work/runs --set ray.temp_dir=$work/ray | tee docs/ui/terminal.txt
PREFECT_SERVER_API_PORT=$port PREFECT_UI_API_URL=http://127.0.0.1:$port/api \
  setsid .venv/bin/prefect server start --host 127.0.0.1 --port "$port" --no-scheduler > "$work/ui.log" 2>&1 &
server=$!
trap 'kill -- -$server 2>/dev/null || true; rm -rf "$work"' EXIT
until curl -sf "127.0.0.1:$port/api/health" > /dev/null; do sleep 2; done
api() { curl -sf -X POST "127.0.0.1:$port/api/$1" -H 'content-type: application/json' -d "$2"; }
pick() { python3 -c "import json, sys; $1"; }
run=$(api flow_runs/filter '{"flows":{"name":{"any_":["training-run"]}}}' | pick 'print(json.load(sys.stdin)[0]["id"])')
step=$(api flow_runs/filter '{"flows":{"name":{"any_":["training-step"]}}}' \
  | pick 'print(next(r["id"] for r in json.load(sys.stdin) if r["name"].endswith("step-00002")))')
latest=$(api artifacts/latest/filter '{}')
table=$(echo "$latest" | pick 'print(next(r["latest_id"] for r in json.load(sys.stdin) if r["key"].endswith("-steps")))')
markdown=$(echo "$latest" | pick 'print(next(r["latest_id"] for r in json.load(sys.stdin) if r["key"].endswith("-step")))')
shot() {
  chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1500,950 \
    --virtual-time-budget=25000 --screenshot="docs/ui/$1" "http://127.0.0.1:$port/$2" > /dev/null 2>&1
}
shot run-timeline.png "runs/flow-run/$run"
shot step-timeline.png "runs/flow-run/$step"
shot step-table.png "artifacts/artifact/$table"
shot step-artifact.png "artifacts/artifact/$markdown"
