#!/usr/bin/env bash
# Builds the pinned tools of the e2e control plane with `go build` and caches them
# outside the repository, reusing every binary whose version stamp still matches.
#
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl  k8s.io/kubernetes ${K8S_VERSION:-v1.36.3}
#   etcd                                                               go.etcd.io/etcd/server/v3 (as pinned by Kubernetes)
#   kwok (+ its shipped Stage YAMLs)                                   sigs.k8s.io/kwok v0.8.0
#   helm                                                               helm.sh/helm/v3 v3.22.0
#   promtool                                                           github.com/prometheus/prometheus v0.316.0 (Prometheus 3.16.0)
#   InferencePool CRDs (not built: YAML copied from the module)       sigs.k8s.io/gateway-api-inference-extension v1.5.0
#   karpenter (its KWOK cloud provider, + its CRDs)                    sigs.k8s.io/karpenter v1.14.1
#
# The versions live in the committed go.mod/go.sum files under e2e/tools/; this script
# only decides what to (re)build. K8S_VERSION picks the control plane: each supported
# version has its module in e2e/tools/k8s/<version>/ and its own cache directory, so
# switching versions rebuilds nothing already built. Output directory (printed at the end):
#   ${SESSIONFLEET_E2E_TOOLS:-${XDG_CACHE_HOME:-~/.cache}/sessionfleet/k8s-${K8S_VERSION}}/bin
#   .../kwok-stages/{node,pod}/...
#   .../gaie-crds/*.yaml
#   .../karpenter-crds/*.yaml
#
# Usage: [K8S_VERSION=v1.37.2] e2e/build-tools.sh [--print-dir]
set -euo pipefail

# The default must match e2e/localcluster/_tools.py's DEFAULT_K8S_VERSION.
K8S_VERSION="${K8S_VERSION:-v1.36.3}"
repo_e2e="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tools_src="${repo_e2e}/tools"
k8s_mod="${tools_src}/k8s/${K8S_VERSION}"
if [[ ! -f "${k8s_mod}/go.mod" ]]; then
  echo "build-tools: K8S_VERSION=${K8S_VERSION} has no module in e2e/tools/k8s/; supported:" \
    "$(cd "${tools_src}/k8s" && ls -d v*/ | tr -d / | tr '\n' ' ')" >&2
  echo "build-tools: add one with e2e/tools/k8s/update-go-mod.sh ${K8S_VERSION}" >&2
  exit 2
fi
cache_root="${SESSIONFLEET_E2E_TOOLS:-${XDG_CACHE_HOME:-${HOME}/.cache}/sessionfleet/k8s-${K8S_VERSION}}"
bin_dir="${cache_root}/bin"
stage_dir="${cache_root}/kwok-stages"
gaie_dir="${cache_root}/gaie-crds"
karpenter_crds_dir="${cache_root}/karpenter-crds"

if [[ "${1:-}" == "--print-dir" ]]; then
  echo "$cache_root"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "build-tools: 'go' is not on PATH; Go >= 1.26 is needed to build the e2e tools" >&2
  exit 1
fi

# Reproducible, VCS-independent builds from the committed module files; -s -w drops
# debug info, which makes the binaries ~30% smaller and the link step faster.
export GOFLAGS="${GOFLAGS:+${GOFLAGS} }-buildvcs=false"
export CGO_ENABLED=0
mkdir -p "$bin_dir" "$stage_dir"

go_version="$(go env GOVERSION)"
started_all=$SECONDS
built=0
reused=0

# Kubernetes binaries report their version from ldflags, as the upstream release
# scripts (hack/lib/version.sh) set them; without this `kubectl version` shows
# v0.0.0-master and Helm's kubeVersion checks in charts fail.
k8s_minor="${K8S_VERSION#v1.}"
k8s_minor="${k8s_minor%%.*}"
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X ${pkg}.gitVersion=${K8S_VERSION} -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${k8s_minor}"
  k8s_ldflags+=" -X ${pkg}.gitTreeState=clean -X ${pkg}.buildDate=1970-01-01T00:00:00Z"
done

# stamp_for MODULE_DIR LDFLAGS PACKAGE -> a line identifying exactly what would be built.
stamp_for() {
  local module_dir="$1" ldflags="$2" package="$3" sums
  sums="$(cat "${module_dir}/go.mod" "${module_dir}/go.sum" | sha256sum | cut -c1-16)"
  echo "${package} ${go_version} mod:${sums} ldflags:$(echo "$ldflags" | sha256sum | cut -c1-16)"
}

# reuse_from_other_version NAME STAMP: the tools that do not depend on the control
# plane's version (KWOK, helm, promtool, Karpenter) are the same build in every
# k8s-<version> cache directory; a binary with an identical stamp there is copied.
reuse_from_other_version() {
  local name="$1" stamp="$2" other
  for other in "${cache_root%/*}"/k8s-v*/bin; do
    [[ "$other" == "$bin_dir" ]] && continue
    if [[ -x "${other}/${name}" && -f "${other}/.${name}.stamp" \
      && "$(cat "${other}/.${name}.stamp")" == "$stamp" ]]; then
      cp -f "${other}/${name}" "${bin_dir}/${name}"
      echo "$stamp" >"${bin_dir}/.${name}.stamp"
      echo "e2e-tools: ${name}: copied from ${other}"
      return 0
    fi
  done
  return 1
}

# build_one NAME MODULE_DIR PACKAGE LDFLAGS: builds PACKAGE into bin/NAME unless the
# stamp next to it says the same inputs were already built.
build_one() {
  local name="$1" module_dir="$2" package="$3" ldflags="$4"
  local stamp_file="${bin_dir}/.${name}.stamp" stamp tmp pid started next_report
  stamp="$(stamp_for "$module_dir" "$ldflags" "$package")"
  if [[ -x "${bin_dir}/${name}" && -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" ]]; then
    echo "e2e-tools: ${name}: cached"
    reused=$((reused + 1))
    return 0
  fi
  if reuse_from_other_version "$name" "$stamp"; then
    reused=$((reused + 1))
    return 0
  fi
  echo "e2e-tools: ${name}: building ${package} ..."
  started=$SECONDS
  tmp="${bin_dir}/.${name}.tmp.$$"
  # Build in the background only to print a heartbeat: the cold kube-apiserver build
  # runs for minutes without output otherwise.
  (cd "$module_dir" && exec go build -trimpath -ldflags "$ldflags" -o "$tmp" "$package") &
  pid=$!
  trap 'kill "$pid" 2>/dev/null; rm -f "$tmp"; exit 130' INT TERM
  next_report=$((started + 30))
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if ((SECONDS >= next_report)) && kill -0 "$pid" 2>/dev/null; then
      echo "e2e-tools: ${name}: still building ($((SECONDS - started)) s)"
      next_report=$((next_report + 30))
    fi
  done
  if ! wait "$pid"; then
    rm -f "$tmp"
    echo "e2e-tools: ${name}: go build ${package} failed (in ${module_dir})" >&2
    exit 1
  fi
  trap - INT TERM
  mv -f "$tmp" "${bin_dir}/${name}"
  echo "$stamp" >"$stamp_file"
  echo "e2e-tools: ${name}: built in $((SECONDS - started)) s"
  built=$((built + 1))
}

# copy_kwok_stages: KWOK v0.8.0 exits with "no stages found" unless it is given Stage
# objects; they ship in its module (kustomize/stage/), so they are copied from the Go
# module cache at build time instead of being committed here.
copy_kwok_stages() {
  local kwok_dir stamp stamp_file="${stage_dir}/.stamp"
  stamp="$(stamp_for "${tools_src}/kwok" "" kustomize/stage)"
  if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" ]]; then
    echo "e2e-tools: kwok stages: cached"
    return 0
  fi
  rm -rf "$stage_dir"
  kwok_dir="$(cd "${tools_src}/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
  if [[ -z "$kwok_dir" || ! -d "${kwok_dir}/kustomize/stage" ]]; then
    echo "e2e-tools: kwok stages: sigs.k8s.io/kwok is not in the module cache" >&2
    exit 1
  fi
  (
    cd "${kwok_dir}/kustomize/stage"
    find node pod -name '*.yaml' -not -path '*/testdata/*' -not -name 'kustomization.yaml' \
      | while read -r file; do
          mkdir -p "${stage_dir}/$(dirname "$file")"
          install -m 0644 "$file" "${stage_dir}/${file}"
        done
  )
  echo "$stamp" >"$stamp_file"
  echo "e2e-tools: kwok stages: copied to ${stage_dir}"
}

# copy_gaie_crds: the Gateway API Inference Extension's CRDs (InferencePool, GA in
# inference.networking.k8s.io/v1) for the EPP's e2e test, from the release pinned in
# e2e/tools/gaie/go.mod: `go mod download` fetches the module (checked against go.sum)
# and its config/crd/bases/ is copied, so no upstream YAML is committed here.
copy_gaie_crds() {
  local module_dir="${tools_src}/gaie" stamp stamp_file="${gaie_dir}/.stamp" info dir version
  stamp="$(stamp_for "$module_dir" "" config/crd/bases)"
  if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" ]]; then
    echo "e2e-tools: GAIE CRDs: cached"
    return 0
  fi
  info="$(cd "$module_dir" && go mod download -json sigs.k8s.io/gateway-api-inference-extension)"
  dir="$(sed -n 's|^[[:space:]]*"Dir": "\(.*\)",$|\1|p' <<<"$info")"
  version="$(sed -n 's|^[[:space:]]*"Version": "\(.*\)",$|\1|p' <<<"$info")"
  if [[ -z "$dir" || ! -d "${dir}/config/crd/bases" ]]; then
    echo "e2e-tools: GAIE CRDs: go mod download gave no config/crd/bases:" >&2
    echo "$info" >&2
    exit 1
  fi
  rm -rf "$gaie_dir"
  mkdir -p "$gaie_dir"
  install -m 0644 "${dir}"/config/crd/bases/*.yaml "$gaie_dir"/
  echo "$version" >"${gaie_dir}/VERSION"
  echo "$stamp" >"$stamp_file"
  echo "e2e-tools: GAIE CRDs ${version}: copied to ${gaie_dir}"
}

# copy_karpenter_crds: the CRDs Karpenter's KWOK provider needs (NodePool, NodeClaim,
# NodeOverlay, CapacityBuffer from kwok/charts/crds/; KWOKNodeClass from
# kwok/apis/crds/), copied from the module that bin/karpenter is built from, with a
# VERSION file naming the release, so no upstream YAML is committed here.
copy_karpenter_crds() {
  local module_dir="${tools_src}/karpenter" stamp stamp_file="${karpenter_crds_dir}/.stamp" dir version sub
  stamp="$(stamp_for "$module_dir" "" kwok/charts/crds+kwok/apis/crds)"
  if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" ]]; then
    echo "e2e-tools: Karpenter CRDs: cached"
    return 0
  fi
  dir="$(cd "$module_dir" && go list -m -f '{{.Dir}}' sigs.k8s.io/karpenter)"
  version="$(cd "$module_dir" && go list -m -f '{{.Version}}' sigs.k8s.io/karpenter)"
  rm -rf "$karpenter_crds_dir"
  mkdir -p "$karpenter_crds_dir"
  for sub in kwok/charts/crds kwok/apis/crds; do
    if [[ -z "$dir" ]] || ! compgen -G "${dir}/${sub}/*.yaml" >/dev/null; then
      echo "e2e-tools: Karpenter CRDs: no ${sub}/*.yaml in sigs.k8s.io/karpenter (${dir:-not in the module cache})" >&2
      exit 1
    fi
    install -m 0644 "${dir}/${sub}"/*.yaml "$karpenter_crds_dir"/
  done
  echo "$version" >"${karpenter_crds_dir}/VERSION"
  echo "$stamp" >"$stamp_file"
  echo "e2e-tools: Karpenter CRDs ${version}: copied to ${karpenter_crds_dir}"
}

echo "e2e-tools: ${go_version}, cache ${cache_root}"
echo "e2e-tools: a cold build takes about 15-20 minutes on 2 cores; later runs reuse the cache"
build_one kube-apiserver "$k8s_mod" k8s.io/kubernetes/cmd/kube-apiserver "$k8s_ldflags"
build_one kube-controller-manager "$k8s_mod" k8s.io/kubernetes/cmd/kube-controller-manager "$k8s_ldflags"
build_one kube-scheduler "$k8s_mod" k8s.io/kubernetes/cmd/kube-scheduler "$k8s_ldflags"
build_one kubectl "$k8s_mod" k8s.io/kubernetes/cmd/kubectl "$k8s_ldflags"
build_one etcd "$k8s_mod" go.etcd.io/etcd/server/v3 "-s -w"
build_one kwok "${tools_src}/kwok" sigs.k8s.io/kwok/cmd/kwok "-s -w"
build_one helm "${tools_src}/helm" helm.sh/helm/v3/cmd/helm "-s -w"
# promtool (`check rules`, `test rules` on the chart's alert rules) reports the version
# upstream's release build stamps into prometheus/common/version; the Go module's
# v0.MMM.P is Prometheus release (MMM / 100).(MMM % 100).P.
prom_module="$(sed -n 's|^[[:space:]]*github.com/prometheus/prometheus \(v[^ ]*\).*$|\1|p' "${tools_src}/promtool/go.mod")"
prom_mmm="${prom_module#v0.}"
prom_mmm="${prom_mmm%%.*}"
prom_release="$((10#${prom_mmm} / 100)).$((10#${prom_mmm} % 100)).${prom_module##*.}"
prom_ldflags="-s -w"
for var in "Version=${prom_release}" "Revision=${prom_module}" "Branch=HEAD" "BuildUser=sessionfleet" "BuildDate=19700101-00:00:00"; do
  prom_ldflags+=" -X github.com/prometheus/common/version.${var}"
done
build_one promtool "${tools_src}/promtool" github.com/prometheus/prometheus/cmd/promtool "$prom_ldflags"
# Karpenter with its KWOK cloud provider (e2e/test_karpenter.py). The package builds a
# binary named `kwok`, hence the explicit name. pkg/operator.Version is "the karpenter
# app version injected during compilation" (its user agent and start-up log).
karpenter_version="$(sed -n 's|^[[:space:]]*sigs.k8s.io/karpenter \(v[^ ]*\).*$|\1|p' "${tools_src}/karpenter/go.mod")"
build_one karpenter "${tools_src}/karpenter" sigs.k8s.io/karpenter/kwok \
  "-s -w -X sigs.k8s.io/karpenter/pkg/operator.Version=${karpenter_version}"
copy_kwok_stages
copy_gaie_crds
copy_karpenter_crds

echo "e2e-tools: done in $((SECONDS - started_all)) s (${built} built, ${reused} cached): ${bin_dir}"
