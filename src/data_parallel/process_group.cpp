// c10d set-up (see process_group.h). Gloo's declarations come from Debian's libgloo-dev; its code
// is LibTorch's own copy (third_party/README.md explains why that is safe).
#include "harness/data_parallel/process_group.h"

#include "harness/data_parallel/debug_sync.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>
#include <stdexcept>

#ifdef HARNESS_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef HARNESS_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace harness::data_parallel {
namespace {

std::string seconds_text(std::chrono::milliseconds timeout) {
  std::ostringstream out;
  out << static_cast<double>(timeout.count()) / 1000.0 << "s";
  return out.str();
}


// True when nothing can listen on `port` (IPv4 wildcard) because another socket holds it.
bool port_in_use(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool in_use = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 &&
                      errno == EADDRINUSE;
  ::close(fd);
  return in_use;
}

void validate(const DistOptions& o) {
  if (o.world_size < 1) {
    throw std::invalid_argument("--world_size " + std::to_string(o.world_size) +
                                " must be at least 1");
  }
  if (o.rank < 0 || o.rank >= o.world_size) {
    throw std::invalid_argument("rank " + std::to_string(o.rank) + " is outside [0, world size " +
                                std::to_string(o.world_size) + ")");
  }
  if (o.master_port < 1 || o.master_port > 65535) {
    throw std::invalid_argument("--master_port " + std::to_string(o.master_port) +
                                " is not a TCP port (1..65535)");
  }
  if (o.master_addr.empty()) throw std::invalid_argument("--master_addr is empty");
  if (o.timeout.count() <= 0) throw std::invalid_argument("the process-group timeout must be > 0");
}

// Rank 0 waits for every rank's "joined" key itself (rather than inside TCPStore), so that a
// rendezvous that times out can say which ranks never arrived.
void wait_for_every_rank(c10d::Store& store, const DistOptions& o, const std::string& where) {
  const std::string prefix = "harness/joined/";
  store.set(prefix + std::to_string(o.rank), std::vector<uint8_t>{1});
  if (o.rank != 0) return;
  const auto deadline = std::chrono::steady_clock::now() + o.timeout;
  for (;;) {
    std::vector<int> missing;
    for (int r = 1; r < o.world_size; ++r) {
      if (!store.check({prefix + std::to_string(r)})) missing.push_back(r);
    }
    if (missing.empty()) return;
    if (std::chrono::steady_clock::now() >= deadline) {
      std::ostringstream msg;
      msg << "rank 0 waited " << seconds_text(o.timeout) << " at " << where << " for the other "
          << o.world_size - 1 << " rank(s) to join the rendezvous; missing: rank"
          << (missing.size() > 1 ? "s " : " ");
      for (size_t i = 0; i < missing.size() && i < 16; ++i) msg << (i ? ", " : "") << missing[i];
      if (missing.size() > 16) msg << ", ...";
      msg << " of --world_size " << o.world_size << "; are they running with the same "
          << "--master_addr/--master_port?";
      throw std::runtime_error(msg.str());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// Under torchrun (use_agent_store) each restart's keys live under a prefix of their own.
c10::intrusive_ptr<c10d::Store> under_attempt_prefix(const DistOptions& o, c10::intrusive_ptr<c10d::TCPStore> tcp) {
  if (!o.use_agent_store) return tcp;
  return c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(o.restart_count), tcp);
}

c10::intrusive_ptr<c10d::Store> connect_store(const DistOptions& o) {
  // Across hosts, a rank with no route to MASTER_ADDR fails now, naming it, not after the
  // rendezvous' timeout.
  if (!is_loopback(o.master_addr)) local_address_toward(o.master_addr, o.master_port);
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(o.master_port);
  store_options.isServer = o.rank == 0 && !o.use_agent_store;
  store_options.numWorkers = static_cast<size_t>(o.world_size);
  store_options.waitWorkers = false;  // wait_for_every_rank below names who is missing
  store_options.timeout = o.timeout;
  const std::string where = o.master_addr + ":" + std::to_string(o.master_port);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = under_attempt_prefix(o, c10::make_intrusive<c10d::TCPStore>(o.master_addr, store_options));
  } catch (const std::exception& e) {
    const std::string what = e.what();
    if (o.rank == 0 && !o.use_agent_store &&
        (port_in_use(o.master_port) || what.find("EADDRINUSE") != std::string::npos)) {
      throw std::runtime_error("MASTER_PORT " + std::to_string(o.master_port) + " on " +
                               o.master_addr + " is in use: pick another with --master_port");
    }
    std::ostringstream msg;
    msg << "rank " << o.rank << " waited " << seconds_text(o.timeout) << " for rank 0 at " << where
        << " (MASTER_ADDR:MASTER_PORT) and could not rendezvous; is rank 0 running, "
        << "and is --master_addr/--master_port the same on every rank?"
        << " (c10d: " << what.substr(0, what.find('\n')) << ")";
    throw std::runtime_error(msg.str());
  }
  wait_for_every_rank(*store, o, where);
  return store;
}

}  // namespace

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

std::string local_address_toward(const std::string& host, int port) {
  const std::string where = host + ":" + std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int resolved = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (resolved != 0 || found == nullptr) {
    throw std::runtime_error("MASTER_ADDR " + host + " does not resolve on this host (" +
                             ::gai_strerror(resolved) + "): set --master_addr to rank 0's address");
  }
  std::string failure;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage own{};
    socklen_t own_size = sizeof(own);
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&own), &own_size) != 0) {
      failure = std::strerror(errno);
      ::close(fd);
      continue;
    }
    ::close(fd);
    char text[INET6_ADDRSTRLEN] = {};
    const void* bytes = own.ss_family == AF_INET6
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&own)->sin6_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&own)->sin_addr);
    if (::inet_ntop(own.ss_family, bytes, text, sizeof(text)) != nullptr) {
      ::freeaddrinfo(found);
      return text;
    }
  }
  ::freeaddrinfo(found);
  throw std::runtime_error("this host has no route to MASTER_ADDR " + where + " (" +
                           (failure.empty() ? "no usable address" : failure) +
                           "): is its network up, and is --master_addr rank 0's address?");
}

GlooInterface choose_gloo_interface(const std::string& master_addr, int master_port,
                                    const char* socket_ifname) {
  GlooInterface choice;
  if (socket_ifname != nullptr && *socket_ifname != '\0') {
    choice.kind = GlooInterface::Kind::kInterfaceName;
    choice.value = socket_ifname;
    choice.reason = "GLOO_SOCKET_IFNAME";
  } else if (is_loopback(master_addr)) {
    choice.value = "127.0.0.1";
    choice.reason = "MASTER_ADDR " + master_addr + " is loopback: one machine";
  } else {
    choice.value = local_address_toward(master_addr, master_port);
    choice.reason = "the address that routes to MASTER_ADDR " + master_addr +
                    "; GLOO_SOCKET_IFNAME overrides";
  }
  return choice;
}

c10::intrusive_ptr<c10d::Store> open_store_client(const DistOptions& o) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(o.master_port);
  store_options.isServer = false;
  store_options.numWorkers = std::nullopt;
  store_options.waitWorkers = false;
  store_options.timeout = o.timeout;
  return under_attempt_prefix(o, c10::make_intrusive<c10d::TCPStore>(o.master_addr, store_options));
}

Backend parse_backend(const std::string& name) {
  if (name == "auto") return Backend::kAuto;
  if (name == "gloo") return Backend::kGloo;
  if (name == "nccl") return Backend::kNccl;
  throw std::invalid_argument("--backend " + name + " is unknown: use auto, gloo or nccl");
}

std::string to_string(Backend backend) {
  switch (backend) {
    case Backend::kAuto: return "auto";
    case Backend::kGloo: return "gloo";
    case Backend::kNccl: return "nccl";
  }
  return "?";
}

Backend resolve_backend(Backend backend, const Device& device) {
  const Backend resolved = backend != Backend::kAuto ? backend : device.is_cuda() ? Backend::kNccl : Backend::kGloo;
  if (resolved == Backend::kNccl && !device.is_cuda()) {
    throw std::invalid_argument("--backend nccl needs a CUDA device, but --device is " +
                                device.str() + ": use --backend gloo (or auto) for CPU devices");
  }
#ifndef HARNESS_WITH_NCCL
  if (resolved == Backend::kNccl) {
    throw std::invalid_argument("--backend nccl: this build has no NCCL support; use --backend gloo");
  }
#endif
#ifndef HARNESS_WITH_GLOO
  if (resolved == Backend::kGloo) {
    throw std::invalid_argument("--backend gloo: this build has no Gloo headers (libgloo-dev)");
  }
#endif
  return resolved;
}

namespace {

// Gloo writes to its peers with writev, which raises SIGPIPE where the peer's socket is gone (a
// process lost, or a generation that went on without this one under --elastic), and SIGPIPE's
// default ends the process before the collective can fail with a reason. Python ignores SIGPIPE
// from its start, so in PyTorch's programs such a write fails with EPIPE and the collective
// raises; here the same holds from the first Gloo group on. (A write to a closed stdout then
// fails too, instead of ending the process, as in Python.)
void let_writes_to_gone_peers_fail() {
  static std::once_flag once;
  std::call_once(once, [] { ::signal(SIGPIPE, SIG_IGN); });
}

c10::intrusive_ptr<c10d::Backend> create_plain_backend(Backend backend,
                                                       const c10::intrusive_ptr<c10d::Store>& store,
                                                       int rank, int world_size,
                                                       const DistOptions& options) {
  if (backend == Backend::kGloo) {
#ifdef HARNESS_WITH_GLOO
    let_writes_to_gone_peers_fail();
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
    // Gloo's default device binds to what the hostname resolves to, which on many hosts is
    // 127.0.1.1 or 127.0.0.1: every peer on another host would then dial its own loopback.
    const GlooInterface choice = choose_gloo_interface(options.master_addr, options.master_port,
                                                       std::getenv("GLOO_SOCKET_IFNAME"));
    gloo_options->devices.push_back(
        choice.kind == GlooInterface::Kind::kInterfaceName
            ? c10d::ProcessGroupGloo::createDeviceForInterface(choice.value)
            : c10d::ProcessGroupGloo::createDeviceForHostname(choice.value));
    if (options.local_rank == 0 && !is_loopback(options.master_addr)) {
      static std::once_flag printed;
      std::call_once(printed, [&] {
        char host[256] = {};
        ::gethostname(host, sizeof(host) - 1);
        std::cerr << "[gloo] host " << host << ": Gloo uses "
                  << (choice.kind == GlooInterface::Kind::kInterfaceName ? "interface " : "address ")
                  << choice.value << " (" << choice.reason << ")" << std::endl;
      });
    }
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, gloo_options);
#else
    throw std::runtime_error("this build has no Gloo headers (libgloo-dev)");
#endif
  }
  if (backend == Backend::kNccl) {
#ifdef HARNESS_WITH_NCCL
    auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
    nccl_options->timeout = options.timeout;
    auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, nccl_options);
    // Collectives without tensors (barrier) then use this rank's GPU, not rank % n_gpus.
    group->setBoundDeviceId(options.device.torch_device());
    return group;
#else
    throw std::runtime_error("this build has no NCCL support");
#endif
  }
  throw std::invalid_argument("create_backend: --backend auto must be resolved first (resolve_backend)");
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> create_backend(Backend backend,
                                                 const c10::intrusive_ptr<c10d::Store>& store,
                                                 int rank, int world_size,
                                                 const DistOptions& options) {
  c10::intrusive_ptr<c10d::Backend> group = create_plain_backend(backend, store, rank, world_size, options);
  if (!options.debug_sync) return group;
  return c10::make_intrusive<DebugSyncBackend>(std::move(group), store, options.group_name, options.timeout);
}

DistOptions dist_options_for(const WorkerEnv& env, Backend backend,
                             const Device& device) {
  DistOptions options;
  options.rank = env.rank;
  options.world_size = env.world_size;
  options.local_rank = env.local_rank;
  options.master_addr = env.master_addr;
  options.master_port = env.master_port;
  options.use_agent_store = env.use_agent_store;
  options.restart_count = env.restart_count;
  options.backend = backend;
  options.device = device;
  return options;
}

DistContext connect_rendezvous_store(const DistOptions& options) {
  validate(options);
  DistContext ctx;
  ctx.rank = options.rank;
  ctx.world_size = options.world_size;
  ctx.local_rank = options.local_rank;
  ctx.device = options.device;
  ctx.backend = resolve_backend(options.backend, options.device);
  if (ctx.backend == Backend::kNccl && !torch::cuda::is_available()) {
    // Before the rendezvous, so that no rank waits for one that cannot start.
    throw std::runtime_error(
        "--backend nccl (or --device " + options.device.str() +
        ") needs a CUDA GPU and none is visible here: use --backend gloo --device cpu");
  }
  ctx.store = connect_store(options);
  return ctx;
}

DistContext init_process_group(const DistOptions& options) {
  DistContext ctx = connect_rendezvous_store(options);
  try {
    ctx.group = create_backend(ctx.backend, ctx.store, ctx.rank, ctx.world_size, options);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const std::string first_line = what.substr(0, what.find('\n'));
    if (ctx.backend == Backend::kGloo) {
      throw std::runtime_error("rank " + std::to_string(ctx.rank) +
                               ": connecting the Gloo process group failed (peers via the store at " +
                               options.master_addr + ":" + std::to_string(options.master_port) +
                               "): " + first_line);
    }
    throw std::runtime_error("rank " + std::to_string(ctx.rank) +
                             ": creating the NCCL process group failed (" + first_line +
                             "); without GPUs use --backend gloo --device cpu");
  }
  return ctx;
}

void all_reduce_sum(const DistContext& ctx, at::Tensor& tensor) {
  TORCH_CHECK(ctx.group, "all_reduce_sum: the DistContext has no process group");
  const bool contiguous = tensor.is_contiguous();
  std::vector<at::Tensor> buffers{contiguous ? tensor : tensor.contiguous()};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  ctx.group->allreduce(buffers, opts)->wait();
  if (!contiguous) {
    at::NoGradGuard no_grad;
    tensor.copy_(buffers[0]);
  }
}

void barrier(const DistContext& ctx) {
  TORCH_CHECK(ctx.group, "barrier: the DistContext has no process group");
  c10d::BarrierOptions opts;
  if (ctx.device.is_cuda()) opts.device = ctx.device.torch_device();
  ctx.group->barrier(opts)->wait();
}

}  // namespace harness::data_parallel
