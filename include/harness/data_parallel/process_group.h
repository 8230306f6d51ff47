// Setting up a c10d process group for one data-parallel rank: a TCP store for the rendezvous
// (rank 0 serves it) and ProcessGroupGloo for CPU tensors or ProcessGroupNCCL for CUDA tensors.
// The resulting DistContext is passed explicitly to what needs it; there is no global state.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

#include "harness/data_parallel/launcher.h"
#include "harness/device.h"

namespace harness::data_parallel {

constexpr int kDefaultMasterPort = 11868;

// --backend: Gloo for CPU tensors, NCCL for CUDA tensors; kAuto picks by the device.
enum class Backend { kAuto, kGloo, kNccl };

// "auto" / "gloo" / "nccl"; anything else throws std::invalid_argument naming --backend.
Backend parse_backend(const std::string& name);
std::string to_string(Backend backend);

struct DistOptions {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  Backend backend = Backend::kAuto;
  std::string master_addr = "localhost";
  int master_port = kDefaultMasterPort;
  Device device = Device::cpu();
  // How long the rendezvous and each collective may take before failing.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  // Under torchrun (see WorkerEnv): connect to the agent's store, keys under
  // "/worker/attempt_<restart_count>/" so that a restarted group never reads a dead one's.
  bool use_agent_store = false;
  int restart_count = 0;
  // --debug_sync: every group this creates compares collective fingerprints before each
  // collective (debug_sync.h); `group_name` names the group in its errors.
  bool debug_sync = false;
  std::string group_name = "the world group";
};

struct DistContext {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  Device device = Device::cpu();
  Backend backend = Backend::kGloo;  // the resolved one: never kAuto
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> group;
};

// kGloo or kNccl for `backend` (kAuto picks by device). Throws std::invalid_argument naming
// --backend / --device when they do not fit together or NCCL was not compiled in.
Backend resolve_backend(Backend backend, const Device& device);

// Rendezvous and process group. Errors (std::runtime_error) say what to change: the port in use
// on rank 0 (--master_port), a rendezvous that timed out (which rank waited for whom, where),
// NCCL without a GPU (--backend gloo --device cpu).
DistContext init_process_group(const DistOptions& options);

// init_process_group without the group: the rendezvous store alone, connected as it connects it
// (under options.use_agent_store, the launcher's, under this attempt's prefix), for a process
// that joins a run under way (launcher.h's replacements) and connects its group later.
DistContext connect_rendezvous_store(const DistOptions& options);

// Another client of the rendezvous store init_process_group connected to (the same server, the
// same prefix under torchrun), for a thread that must not wait behind the process's own client
// (elastic_rendezvous.h's Heartbeat). No rendezvous: it only connects.
c10::intrusive_ptr<c10d::Store> open_store_client(const DistOptions& options);

// The options of the worker `env` describes (rank, world size, local rank, rendezvous address)
// with `backend` and `device`; the timeout stays the default.
DistOptions dist_options_for(const WorkerEnv& env, Backend backend = Backend::kAuto,
                             const Device& device = Device::cpu());

// Whether `host` names this machine's loopback ("localhost", 127.x.y.z, "::1"): a run on one machine.
bool is_loopback(const std::string& host);

// The local address this host uses to reach `host` (a name or an address) at `port`: the own
// address of a UDP socket connected toward it, as NCCL matches its bootstrap interface (no packet
// is sent). Throws std::runtime_error naming host and port when the name does not resolve or no
// route leads there (a host cut off from MASTER_ADDR fails here, before any rendezvous).
std::string local_address_toward(const std::string& host, int port);

// Which interface Gloo binds to, as data: GLOO_SOCKET_IFNAME when set (PyTorch's variable still
// wins); 127.0.0.1 when MASTER_ADDR is loopback (one machine); else the address that routes to
// MASTER_ADDR, so that a rank on several hosts never advertises its hostname's loopback address.
struct GlooInterface {
  enum class Kind { kInterfaceName, kAddress };
  Kind kind = Kind::kAddress;
  std::string value;   // the interface's name, or the address to bind
  std::string reason;  // why this one, for the line each host prints
};
GlooInterface choose_gloo_interface(const std::string& master_addr, int master_port,
                                    const char* socket_ifname);

// A Gloo or NCCL backend (kAuto is refused) for `rank` of `world_size` over `store` (the rendezvous of a group),
// on the interface choose_gloo_interface picks (printed once per host, local rank 0, when
// MASTER_ADDR is not loopback) and options.device bound for NCCL, wrapped in a DebugSyncBackend under
// options.debug_sync. c10d's exceptions propagate: the caller says
// which group failed.
c10::intrusive_ptr<c10d::Backend> create_backend(Backend backend,
                                                 const c10::intrusive_ptr<c10d::Store>& store,
                                                 int rank, int world_size,
                                                 const DistOptions& options);

// In-place SUM all-reduce of one tensor across the group (dense; copied through a contiguous
// buffer when it is not contiguous). Blocks until done.
void all_reduce_sum(const DistContext& ctx, at::Tensor& tensor);

// Every rank waits until all ranks reach this point.
void barrier(const DistContext& ctx);

}  // namespace harness::data_parallel
