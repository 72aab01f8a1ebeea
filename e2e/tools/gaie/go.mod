module sessionfleet.dev/e2e/tools/gaie

go 1.26.7

// Not built: e2e/build-tools.sh copies the InferencePool CRDs (config/crd/bases/) of
// this release from the Go module cache for the EPP's e2e test.
require sigs.k8s.io/gateway-api-inference-extension v1.5.0
