// save_tensor_dict_pth, read back by Python's torch.load with default arguments, and the
// gradient-file checker script on matching and mismatching files.
#include "harness/data_parallel/checkpoint_io.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "test_support.h"

namespace harness::data_parallel {
namespace {

namespace fs = std::filesystem;

const std::string kPython = std::string(HARNESS_SOURCE_DIR) + "/.venv/bin/python";

int run_python_file(const fs::path& script, const std::string& args) {
  const std::string command = kPython + " " + script.string() + " " + args;
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

class PthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("dp_pth_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { testing::remove_tree(dir_.string()); }
  fs::path dir_;
};

TEST_F(PthTest, TorchLoadWithDefaultsReturnsAPlainDictOfTensors) {
  const fs::path file = dir_ / "tensors.pth";
  save_tensor_dict_pth(
      file.string(),
      {{"transformer.wte.weight", torch::arange(6, torch::kFloat32).reshape({2, 3})},
       {"ids", torch::tensor({7, -1, 5}, torch::kInt64)},
       {"transposed", torch::arange(6, torch::kFloat64).reshape({2, 3}).t()},  // non-contiguous
       {"scalar", torch::tensor(2.5f)},
       {"slice", torch::arange(10, torch::kFloat32).slice(0, 4, 7)},  // a view with an offset
       {"grad", torch::ones({2}, torch::requires_grad())}});
  const fs::path script = dir_ / "check.py";
  std::ofstream(script) << R"(import sys, torch
d = torch.load(sys.argv[1])
assert type(d) is dict, type(d)
assert list(d) == ["transformer.wte.weight", "ids", "transposed", "scalar", "slice", "grad"], list(d)
assert all(type(v) is torch.Tensor for v in d.values())
assert torch.equal(d["transformer.wte.weight"], torch.arange(6.).reshape(2, 3))
assert d["ids"].dtype == torch.int64 and d["ids"].tolist() == [7, -1, 5]
assert d["transposed"].dtype == torch.float64
assert torch.equal(d["transposed"], torch.arange(6, dtype=torch.float64).reshape(2, 3).t())
assert d["scalar"].shape == () and d["scalar"].item() == 2.5
assert d["slice"].tolist() == [4.0, 5.0, 6.0]
assert not d["grad"].requires_grad and d["grad"].tolist() == [1.0, 1.0]
print("torch.load ok")
)";
  EXPECT_EQ(run_python_file(script, file.string()), 0);
}

TEST_F(PthTest, RejectsBadInput) {
  const std::string path = (dir_ / "bad.pth").string();
  EXPECT_THROW(save_tensor_dict_pth(path, {{"a", torch::ones(1)}, {"a", torch::ones(1)}}),
               std::invalid_argument);
  EXPECT_THROW(save_tensor_dict_pth(path, {{"", torch::ones(1)}}), std::invalid_argument);
  EXPECT_THROW(save_tensor_dict_pth(path, {{"u", at::Tensor()}}), std::invalid_argument);
  try {
    save_tensor_dict_pth((dir_ / "missing_dir" / "x.pth").string(), {{"a", torch::ones(1)}});
    FAIL() << "writing into a missing folder succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("missing_dir"), std::string::npos) << e.what();
  }
}

TEST_F(PthTest, CheckGradientsScriptAcceptsEqualAndRejectsDifferentFiles) {
  const fs::path script = fs::path(HARNESS_SOURCE_DIR) / "scripts" / "check_gradients.py";
  const auto a = torch::randn({3, 4});
  const auto b = torch::randn({4});
  save_tensor_dict_pth((dir_ / "model0_gradients.pth").string(), {{"w", a}, {"b", b}});
  save_tensor_dict_pth((dir_ / "model1_gradients.pth").string(), {{"w", a.clone()}, {"b", b}});
  EXPECT_EQ(run_python_file(script, dir_.string()), 0);

  // One ulp of difference in one element is a failure.
  auto nudged = a.clone();
  nudged[1][2] = std::nextafter(a[1][2].item<float>(), 1e9f);
  save_tensor_dict_pth((dir_ / "model1_gradients.pth").string(), {{"w", nudged}, {"b", b}});
  EXPECT_NE(run_python_file(script, dir_.string()), 0);

  save_tensor_dict_pth((dir_ / "model1_gradients.pth").string(), {{"w", a}});
  EXPECT_NE(run_python_file(script, dir_.string()), 0);
  fs::remove(dir_ / "model1_gradients.pth");
  EXPECT_NE(run_python_file(script, dir_.string()), 0);
}

}  // namespace
}  // namespace harness::data_parallel
