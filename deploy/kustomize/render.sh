#!/usr/bin/env bash
# Render the kustomize base and the router component from the Helm chart, so that
# the chart stays the single source of every manifest (make kustomize-manifests).
# e2e/test_chart.py renders into a scratch folder and fails when the committed
# files drift.
#
#   deploy/kustomize/render.sh [--if-available] [OUTPUT_DIR]   # default: deploy/kustomize
#
# --if-available: without helm, say so and succeed (`make crds` renders when it can).
set -euo pipefail
cd "$(dirname "$0")/../.."
TOOLS="${SESSIONFLEET_E2E_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/sessionfleet/k8s-v1.36.3}"
HELM="${HELM:-$TOOLS/bin/helm}"
optional=false
if [[ "${1:-}" == "--if-available" ]]; then
  optional=true
  shift
fi
OUT="${1:-deploy/kustomize}"
if [[ ! -x "$HELM" ]]; then
  if $optional; then
    echo "render.sh: no helm at $HELM; deploy/kustomize not re-rendered (make e2e-tools)"
    exit 0
  fi
  echo "render.sh: no helm at $HELM: run \`make e2e-tools\` or set HELM" >&2
  exit 1
fi
# The kube version only satisfies the chart's kubeVersion check for helm builds that
# do not carry one; the output does not depend on it.
common=(template sessionfleet charts/sessionfleet --namespace sessionfleet-system
        --kube-version v1.36.3)
header() {
  echo "# Rendered from charts/sessionfleet by deploy/kustomize/render.sh ($1)."
  echo "# Do not edit by hand: change the chart and run \`make kustomize-manifests\`."
}
mkdir -p "$OUT/base" "$OUT/components/router"
{
  header "the CRDs and the operator"
  "$HELM" "${common[@]}" --set router.enabled=false
} > "$OUT/base/sessionfleet.yaml"
{
  header "the router"
  "$HELM" "${common[@]}" \
    --show-only templates/router/deployment.yaml \
    --show-only templates/router/rbac.yaml \
    --show-only templates/lease-admission.yaml
} > "$OUT/components/router/router.yaml"
echo "wrote $OUT/base/sessionfleet.yaml and $OUT/components/router/router.yaml"
