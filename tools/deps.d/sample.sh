# shellcheck shell=bash
# Real-input sample (data/smollm2_kjv_sample.safetensors, docs/real-input-sample.md): sourced by
# tools/install-deps.sh so that the test command has it for the 'examples' suite (examples/demo_real).
# tools/fetch-sample.sh returns at once when the file exists and passes its check. A failure (no network,
# say) is a warning, not an error: the other suites still build and run, and demo_real reports a skip.
if ! bash tools/fetch-sample.sh; then
  echo "install-deps: warning: tools/fetch-sample.sh failed; the demo test (suite 'examples') will be skipped" >&2
fi
