// libFuzzer target for train::read_manifest (the input as a scratch folder's manifest.json): a
// manifest or a runtime_error; a manifest read is written back (as commit() does) unchanged.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "harness/train/checkpoint/checkpoint_store.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace harness::train;
  using harness::fuzz::require;
  harness::fuzz::write_scratch(kManifestName, data, size);
  const auto manifest = harness::fuzz::parsed_or_rejected(
      [&] { return read_manifest(harness::fuzz::scratch_dir()); });
  if (!manifest) return 0;
  const nlohmann::json written = manifest_to_json(*manifest);
  require(!written.dump(2).empty(), "the manifest serialises");  // commit() writes dump(2)
  const CheckpointManifest again = manifest_from_json(written, "fuzz/written manifest.json");
  require(manifest_to_json(again) == written, "manifest round trip keeps every field");
  return 0;
}
