// Checkpoint storage without torch: SHA-256 against the FIPS vectors, the strict manifest reader,
// the atomic writer under a failure injected at each stage, verification and pruning.
#include "harness/train/checkpoint/checkpoint_store.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>

namespace harness::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The message of what `action` throws as std::runtime_error; fails the test when it does not throw.
template <typename Action>
std::string runtime_error_of(Action action) {
  try {
    action();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a std::runtime_error";
  return "";
}

class CheckpointStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "checkpoint_store_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << pattern << ": " << std::strerror(errno);
    dir_ = pattern;
    root_ = dir_ + "/checkpoints";
  }
  void TearDown() override {
    if (!dir_.empty()) remove_tree(dir_);
  }

  std::string read_text(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  // Names under root_ that start with '.': temporary folders a writer left behind.
  std::vector<std::string> hidden_entries() {
    std::vector<std::string> names;
    if (!fs::exists(root_)) return names;
    for (const auto& entry : fs::directory_iterator(root_)) {
      const std::string name = entry.path().filename().string();
      if (name[0] == '.') names.push_back(name);
    }
    return names;
  }

  static CheckpointManifest sample_manifest(int64_t step) {
    CheckpointManifest m;
    m.program = "run_pipeline";
    m.plan = {{"world_size", 4}, {"tensor_parallel_size", 2}, {"data_parallel_size", 2}, {"zero_stage", 1}};
    m.pipeline_devices = {"cuda:0", "cuda:1"};
    m.model_config = {{"n_layer", 2}, {"n_embd", 64}, {"model_type", "gpt2"}};
    m.global_step = step;
    m.epoch = 3;
    m.batch_in_epoch = 17;
    m.created_at = "2024-05-01T12:00:00Z";
    return m;
  }

  // A checkpoint with a file written through path_for and one through add_bytes.
  std::string write_checkpoint(int64_t step, const std::string& payload) {
    CheckpointWriter writer(root_, step);
    write_file_synced(writer.path_for("model.safetensors"), payload + "-model");
    writer.add_file("model.safetensors");
    writer.add_bytes("optimizer/rank0.safetensors", payload + "-optimizer");
    return writer.commit(sample_manifest(step));
  }

  std::string dir_;
  std::string root_;
};

// --- SHA-256 -------------------------------------------------------------------------------------

TEST(Sha256Test, FipsTestVectors) {
  EXPECT_EQ(sha256_hex("", 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc", 3),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  ASSERT_EQ(two_blocks.size() * 8, 448u);
  EXPECT_EQ(sha256_hex(two_blocks.data(), two_blocks.size()),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million_a(1000000, 'a');
  EXPECT_EQ(sha256_hex(million_a.data(), million_a.size()),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_F(CheckpointStoreTest, Sha256FileStreamsToTheSameDigest) {
  // Larger than the 1 MiB read chunk and not a multiple of the 64-byte block.
  std::string bytes(3 * (1 << 20) + 777, '\0');
  uint32_t x = 12345;
  for (char& c : bytes) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  const std::string path = dir_ + "/blob.bin";
  write_file_synced(path, bytes);
  EXPECT_EQ(fs::file_size(path), bytes.size());
  EXPECT_EQ(sha256_file(path), sha256_hex(bytes.data(), bytes.size()));

  const std::string missing = dir_ + "/missing.bin";
  EXPECT_NE(runtime_error_of([&] { sha256_file(missing); }).find(missing), std::string::npos);
}

// --- file helpers --------------------------------------------------------------------------------

TEST_F(CheckpointStoreTest, RemoveTreeRemovesNestedFoldersWithoutFollowingLinks) {
  const std::string outside = dir_ + "/outside.txt";
  write_file_synced(outside, "keep me");
  const std::string tree = dir_ + "/tree";
  fs::create_directories(tree + "/a/b/c");
  write_file_synced(tree + "/a/b/c/file", "x");
  write_file_synced(tree + "/top", "y");
  fs::create_symlink(outside, tree + "/a/link_to_outside");
  fs::create_directory_symlink(dir_, tree + "/a/link_to_parent");

  remove_tree(tree);
  EXPECT_FALSE(fs::exists(fs::symlink_status(tree)));
  EXPECT_EQ(read_text(outside), "keep me");

  remove_tree(tree);     // missing: not an error
  remove_tree(outside);  // a single file
  EXPECT_FALSE(fs::exists(outside));
}

TEST_F(CheckpointStoreTest, WriteFileSyncedNamesThePathOnFailure) {
  const std::string path = dir_ + "/no/such/folder/file";
  const std::string message = runtime_error_of([&] { write_file_synced(path, "x"); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("No such file or directory"), std::string::npos) << message;

  write_file_synced(dir_ + "/f", "longer content");
  write_file_synced(dir_ + "/f", "short");  // truncates
  EXPECT_EQ(read_text(dir_ + "/f"), "short");
  fsync_path(dir_ + "/f");
  fsync_path(dir_);
  EXPECT_THROW(fsync_path(dir_ + "/missing"), std::runtime_error);
}

// --- manifest ------------------------------------------------------------------------------------

TEST_F(CheckpointStoreTest, ManifestRoundTripsFieldByField) {
  CheckpointManifest m = sample_manifest(1234567890123);
  m.files = {{"model.safetensors", 1200, std::string(64, 'a')},
             {"optimizer/rank1.safetensors", 0, sha256_hex("", 0)}};
  const CheckpointManifest back =
      manifest_from_json(json::parse(manifest_to_json(m).dump()), "test");
  EXPECT_EQ(back.format_version, kCheckpointFormatVersion);
  EXPECT_EQ(back.program, m.program);
  EXPECT_EQ(back.plan, m.plan);
  EXPECT_EQ(back.pipeline_devices, m.pipeline_devices);
  EXPECT_EQ(back.model_config, m.model_config);
  EXPECT_EQ(back.global_step, m.global_step);
  EXPECT_EQ(back.epoch, m.epoch);
  EXPECT_EQ(back.batch_in_epoch, m.batch_in_epoch);
  EXPECT_EQ(back.created_at, m.created_at);
  ASSERT_EQ(back.files.size(), m.files.size());
  for (size_t i = 0; i < m.files.size(); ++i) {
    EXPECT_EQ(back.files[i].name, m.files[i].name);
    EXPECT_EQ(back.files[i].size, m.files[i].size);
    EXPECT_EQ(back.files[i].sha256, m.files[i].sha256);
  }
}

TEST_F(CheckpointStoreTest, BadManifestsAreRefusedNamingTheField) {
  CheckpointManifest m = sample_manifest(12);
  m.files = {{"model.safetensors", 10, std::string(64, '0')},
             {"optimizer.safetensors", 20, std::string(64, '1')}};
  const json good = manifest_to_json(m);
  const std::string origin = "/ckpt/step-00000012/manifest.json";
  EXPECT_NO_THROW(manifest_from_json(good, origin));

  struct Case {
    std::string what;
    std::function<void(json&)> damage;
    std::vector<std::string> expected;  // substrings of the message
  };
  const std::vector<Case> cases = {
      {"missing field", [](json& j) { j.erase("global_step"); }, {"'global_step'", "missing"}},
      {"wrong type",
       [](json& j) { j["global_step"] = "12"; },
       {"'global_step'", "integer", "string"}},
      {"negative step", [](json& j) { j["epoch"] = -1; }, {"'epoch'", ">= 0"}},
      {"zero world", [](json& j) { j["world_size"] = 0; }, {"'world_size'", ">= 1"}},
      {"plan not object", [](json& j) { j["plan"] = 3; }, {"'plan'", "object"}},
      {"plan disagrees", [](json& j) { j["plan"]["world_size"] = 8; }, {"'plan.world_size'", "is 8", "4"}},
      {"fractional", [](json& j) { j["batch_in_epoch"] = 1.5; }, {"'batch_in_epoch'", "integer"}},
      {"other version",
       [](json& j) { j["format_version"] = 2; },
       {"'format_version'", "is 2", "format_version 1"}},
      {"unknown field", [](json& j) { j["learning_rate"] = 1e-4; }, {"'learning_rate'"}},
      {"config not object",
       [](json& j) { j["model_config"] = json::array(); },
       {"'model_config'", "object"}},
      {"device not string",
       [](json& j) { j["pipeline_devices"][1] = 1; },
       {"'pipeline_devices[1]'"}},
      {"bad hex",
       [](json& j) { j["files"][1]["sha256"] = std::string(64, 'G'); },
       {"'files[1].sha256'", "hex"}},
      {"uppercase hex",
       [](json& j) { j["files"][0]["sha256"] = std::string(64, 'A'); },
       {"'files[0].sha256'"}},
      {"short hex", [](json& j) { j["files"][0]["sha256"] = "abc"; }, {"'files[0].sha256'"}},
      {"negative size", [](json& j) { j["files"][0]["size"] = -5; }, {"'files[0].size'", ">= 0"}},
      {"parent name",
       [](json& j) { j["files"][1]["name"] = "../x"; },
       {"'files[1].name'", "../x", ".."}},
      {"inner parent", [](json& j) { j["files"][1]["name"] = "a/../../x"; }, {"'files[1].name'"}},
      {"absolute name",
       [](json& j) { j["files"][0]["name"] = "/etc/passwd"; },
       {"'files[0].name'", "absolute"}},
      {"manifest listed",
       [](json& j) { j["files"][0]["name"] = "manifest.json"; },
       {"'files[0].name'"}},
      {"duplicate file",
       [](json& j) { j["files"][1]["name"] = "model.safetensors"; },
       {"'files[1].name'", "twice"}},
      {"file missing size",
       [](json& j) { j["files"][0].erase("size"); },
       {"'files[0].size'", "missing"}},
      {"files not array", [](json& j) { j["files"] = "none"; }, {"'files'", "array"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    json bad = good;
    c.damage(bad);
    const std::string message = runtime_error_of([&] { manifest_from_json(bad, origin); });
    EXPECT_EQ(message.rfind(origin + ": ", 0), 0u) << message;
    for (const std::string& part : c.expected)
      EXPECT_NE(message.find(part), std::string::npos) << message;
  }
  EXPECT_THROW(manifest_from_json(json::array(), origin), std::runtime_error);
}

TEST_F(CheckpointStoreTest, ReadManifestNamesTheFileOnBadJson) {
  const std::string folder = dir_ + "/step-00000001";
  fs::create_directories(folder);
  const std::string path = folder + "/manifest.json";

  write_file_synced(path, "{\"format_version\": 1,");
  std::string message = runtime_error_of([&] { read_manifest(folder); });
  EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << message;

  write_file_synced(path, std::string(100000, '[') + std::string(100000, ']'));
  message = runtime_error_of([&] { read_manifest(folder); });
  EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << message;
  EXPECT_NE(message.find("nests"), std::string::npos) << message;

  remove_tree(path);
  message = runtime_error_of([&] { read_manifest(folder); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
}

// --- names ---------------------------------------------------------------------------------------

TEST(CheckpointNameTest, RoundTripsAndRefusesOtherNames) {
  EXPECT_EQ(checkpoint_name(12), "step-00000012");
  EXPECT_EQ(checkpoint_name(0), "step-00000000");
  EXPECT_EQ(checkpoint_name(123456789), "step-123456789");
  for (int64_t step : {int64_t{0}, int64_t{12}, int64_t{99999999}, int64_t{100000000}, INT64_MAX}) {
    EXPECT_EQ(parse_checkpoint_name(checkpoint_name(step)), std::optional<int64_t>(step)) << step;
  }
  EXPECT_THROW(checkpoint_name(-1), std::invalid_argument);
  for (const std::string name :
       {"step-", "step-12a", ".step-00000001.tmp-5", "step-12", "step-000000012", "step--0000001",
        "step-0000001a", "Step-00000001", "step-00000001/", "step-99999999999999999999", ""}) {
    EXPECT_FALSE(parse_checkpoint_name(name).has_value()) << name;
  }
}

// --- writer, listing, verification ---------------------------------------------------------------

TEST_F(CheckpointStoreTest, CommittedCheckpointIsListedAndVerifies) {
  EXPECT_TRUE(list_checkpoints(root_).empty());  // root does not exist yet
  const std::string path = write_checkpoint(7, "seven");
  EXPECT_EQ(path, root_ + "/step-00000007");

  const std::vector<CheckpointInfo> listed = list_checkpoints(root_);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].global_step, 7);
  EXPECT_EQ(listed[0].path, path);
  EXPECT_TRUE(hidden_entries().empty());

  const CheckpointManifest m = verify_checkpoint(path);
  EXPECT_EQ(m.global_step, 7);
  EXPECT_EQ(m.program, "run_pipeline");
  ASSERT_EQ(m.files.size(), 2u);
  EXPECT_EQ(m.files[0].name, "model.safetensors");
  EXPECT_EQ(m.files[0].size, std::string("seven-model").size());
  EXPECT_EQ(m.files[0].sha256, sha256_hex("seven-model", 11));
  EXPECT_EQ(m.files[1].name, "optimizer/rank0.safetensors");
  EXPECT_EQ(read_text(path + "/optimizer/rank0.safetensors"), "seven-optimizer");
}

TEST_F(CheckpointStoreTest, WriterRefusesMisuse) {
  CheckpointWriter writer(root_, 3);
  EXPECT_THROW(writer.add_file("never-written.bin"), std::runtime_error);
  EXPECT_THROW(writer.path_for("../escape"), std::invalid_argument);
  EXPECT_THROW(writer.add_bytes("manifest.json", "{}"), std::invalid_argument);
  writer.add_bytes("a.bin", "a");
  EXPECT_THROW(writer.add_bytes("a.bin", "again"), std::invalid_argument);
  EXPECT_THROW(writer.commit(sample_manifest(4)), std::invalid_argument);  // other step
  writer.commit(sample_manifest(3));
  EXPECT_THROW(writer.commit(sample_manifest(3)), std::logic_error);
  EXPECT_THROW(writer.add_bytes("b.bin", "b"), std::logic_error);
}

TEST_F(CheckpointStoreTest, FailureAtEachStageLeavesOnlyThePreviousCheckpoint) {
  const std::string previous = write_checkpoint(1, "one");
  using Stage = CheckpointWriter::Stage;
  for (Stage failing : {Stage::kCreateTemp, Stage::kAddFile, Stage::kWriteManifest,
                        Stage::kSyncTemp, Stage::kRename, Stage::kSyncRoot}) {
    SCOPED_TRACE("stage " + std::to_string(static_cast<int>(failing)));
    bool reached = false;
    auto on_stage = [&](Stage s) {
      if (s == failing) {
        reached = true;
        throw std::runtime_error("injected");
      }
    };
    try {
      CheckpointWriter writer(root_, 2, on_stage);
      write_file_synced(writer.path_for("model.safetensors"), "two-model");
      writer.add_file("model.safetensors");
      writer.add_bytes("optimizer.safetensors", "two-optimizer");
      writer.commit(sample_manifest(2));
      ADD_FAILURE() << "the injected failure did not propagate";
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "injected");
    }
    EXPECT_TRUE(reached);
    const std::vector<CheckpointInfo> listed = list_checkpoints(root_);
    ASSERT_EQ(listed.size(), 1u);
    EXPECT_EQ(listed[0].path, previous);
    EXPECT_NO_THROW(verify_checkpoint(previous));
    EXPECT_FALSE(fs::exists(root_ + "/step-00000002"));
    EXPECT_TRUE(hidden_entries().empty()) << hidden_entries()[0];
  }
  // Nothing left in the way of the same step succeeding now.
  const std::string path = write_checkpoint(2, "two");
  EXPECT_EQ(list_checkpoints(root_).size(), 2u);
  EXPECT_NO_THROW(verify_checkpoint(path));
}

TEST_F(CheckpointStoreTest, CommitReplacesAnIncompleteOrOlderFolderOfTheSameStep) {
  fs::create_directories(root_ + "/step-00000005");
  write_file_synced(root_ + "/step-00000005/model.safetensors", "partial");
  EXPECT_TRUE(list_checkpoints(root_).empty());  // no manifest: not complete

  write_checkpoint(5, "first");
  const std::string path = write_checkpoint(5, "second");
  EXPECT_EQ(verify_checkpoint(path).files.size(), 2u);
  EXPECT_EQ(read_text(path + "/model.safetensors"), "second-model");
  EXPECT_EQ(list_checkpoints(root_).size(), 1u);
  EXPECT_TRUE(hidden_entries().empty());
}

TEST_F(CheckpointStoreTest, ListingIgnoresEverythingButCompleteCheckpointsAndSortsBySteps) {
  write_checkpoint(100000000, "wide");
  write_checkpoint(99999999, "narrow");
  write_checkpoint(3, "three");
  fs::create_directories(root_ + "/.step-00000004.tmp-1");
  write_file_synced(root_ + "/.step-00000004.tmp-1/manifest.json", "{}");
  fs::create_directories(root_ + "/step-4");
  write_file_synced(root_ + "/step-4/manifest.json", "{}");
  write_file_synced(root_ + "/step-00000006", "a file, not a folder");
  fs::create_directories(root_ + "/runs");

  const std::vector<CheckpointInfo> listed = list_checkpoints(root_);
  ASSERT_EQ(listed.size(), 3u);
  EXPECT_EQ(listed[0].global_step, 3);
  EXPECT_EQ(listed[1].global_step, 99999999);
  EXPECT_EQ(listed[2].global_step, 100000000);
  EXPECT_EQ(listed[2].path, root_ + "/step-100000000");
}

TEST_F(CheckpointStoreTest, VerifyRefusesDamagedCheckpoints) {
  const std::string path = write_checkpoint(9, "payload-of-some-length");
  const std::string model = path + "/model.safetensors";
  const std::string original = read_text(model);

  write_file_synced(model, original.substr(0, original.size() - 4));
  std::string message = runtime_error_of([&] { verify_checkpoint(path); });
  EXPECT_NE(message.find(path + ": model.safetensors has " + std::to_string(original.size() - 4) +
                         " bytes, the manifest says " + std::to_string(original.size())),
            std::string::npos)
      << message;

  std::string corrupted = original;
  corrupted[5] ^= 0x01;
  write_file_synced(model, corrupted);
  message = runtime_error_of([&] { verify_checkpoint(path); });
  EXPECT_NE(
      message.find(path + ": model.safetensors SHA-256 differs from the manifest (corrupted)"),
      std::string::npos)
      << message;

  write_file_synced(model, original);
  EXPECT_NO_THROW(verify_checkpoint(path));

  remove_tree(path + "/optimizer/rank0.safetensors");
  message = runtime_error_of([&] { verify_checkpoint(path); });
  EXPECT_NE(message.find(path + ": optimizer/rank0.safetensors"), std::string::npos) << message;
  EXPECT_NE(message.find("missing"), std::string::npos) << message;

  remove_tree(path + "/manifest.json");
  message = runtime_error_of([&] { verify_checkpoint(path); });
  EXPECT_NE(message.find(path + "/manifest.json"), std::string::npos) << message;
}

TEST_F(CheckpointStoreTest, VerifyRefusesAManifestForAnotherStep) {
  const std::string path = write_checkpoint(9, "nine");
  fs::rename(path, root_ + "/step-00000010");
  const std::string message =
      runtime_error_of([&] { verify_checkpoint(root_ + "/step-00000010"); });
  EXPECT_NE(message.find("global_step 9"), std::string::npos) << message;
}

// --- pruning -------------------------------------------------------------------------------------

TEST_F(CheckpointStoreTest, PruneKeepsTheNewestAndRemovesStaleTemporaryFolders) {
  for (int64_t step = 1; step <= 5; ++step) write_checkpoint(step * 10, "s" + std::to_string(step));

  const pid_t dead_pid = (1 << 22) + 12345;  // above Linux's largest pid_max
  ASSERT_EQ(::kill(dead_pid, 0), -1);
  ASSERT_EQ(errno, ESRCH);
  const std::string own = std::to_string(::getpid());
  const std::string dead_temp = root_ + "/.step-00000060.tmp-" + std::to_string(dead_pid);
  const std::string dead_discard =
      root_ + "/.step-00000010.tmp-" + std::to_string(dead_pid) + ".discard-0";
  const std::string own_stale = root_ + "/.step-00000070.tmp-" + own + ".discard-4";
  const std::string live_other = root_ + "/.step-00000060.tmp-1";  // init: running, maybe not ours
  fs::create_directories(dead_temp + "/sub");
  write_file_synced(dead_temp + "/sub/model.safetensors", "half written");
  fs::create_directories(dead_discard);
  fs::create_directories(own_stale);
  fs::create_directories(live_other);

  CheckpointWriter in_progress(root_, 80);
  in_progress.add_bytes("model.safetensors", "writing");

  EXPECT_THROW(prune_checkpoints(root_, 0), std::invalid_argument);
  std::vector<std::string> removed = prune_checkpoints(root_, 2, in_progress.temp_path());
  std::sort(removed.begin(), removed.end());
  std::vector<std::string> expected = {root_ + "/step-00000010",
                                       root_ + "/step-00000020",
                                       root_ + "/step-00000030",
                                       dead_discard,
                                       dead_temp,
                                       own_stale};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(removed, expected);

  const std::vector<CheckpointInfo> listed = list_checkpoints(root_);
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].global_step, 40);
  EXPECT_EQ(listed[1].global_step, 50);
  for (const CheckpointInfo& info : listed) EXPECT_NO_THROW(verify_checkpoint(info.path));
  for (const std::string& path : expected) EXPECT_FALSE(fs::exists(path)) << path;
  EXPECT_TRUE(fs::exists(live_other));
  EXPECT_TRUE(fs::exists(in_progress.temp_path()));

  // The writer still commits after the prune, and a prune without it in use keeps the newest 2.
  in_progress.commit(sample_manifest(80));
  removed = prune_checkpoints(root_, 2);
  EXPECT_EQ(removed, std::vector<std::string>{root_ + "/step-00000040"});
  EXPECT_EQ(list_checkpoints(root_).back().global_step, 80);
  EXPECT_TRUE(prune_checkpoints(dir_ + "/no-such-root", 1).empty());
}

}  // namespace
}  // namespace harness::train
