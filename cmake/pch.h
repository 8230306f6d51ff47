// Headers precompiled once and shared by every target (see harness_use_pch in CMakeLists.txt).
#pragma once
#include <torch/torch.h>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>
