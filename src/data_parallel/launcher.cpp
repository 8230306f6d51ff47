// The worker launcher (see launcher.h): fork/exec, line forwarding through pipes, and stopping
// everything on the first failure or on SIGINT/SIGTERM.
#include "harness/data_parallel/launcher.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "harness/data_parallel/elastic_rendezvous.h"

#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>
#include <stdexcept>

extern char** environ;

namespace harness::data_parallel {
namespace {

// The launch's scratch folder, every worker's TMPDIR, made under the launcher's own temporary
// folder and removed with whatever is in it once the workers are gone: what a worker killed by a
// signal leaves there (its copy of the tokenizer, say) does not outlive the launch.
class ScratchFolder {
 public:
  ScratchFolder() {
    std::string pattern = (std::filesystem::temp_directory_path() / "harness-launch-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw std::runtime_error("launcher: cannot make a scratch folder like " + pattern + ": " + std::strerror(errno));
    }
    path_ = pattern;
  }
  ScratchFolder(const ScratchFolder&) = delete;
  ScratchFolder& operator=(const ScratchFolder&) = delete;
  ~ScratchFolder() {
    // Depth first, links not followed.
    (void)::nftw(
        path_.c_str(), [](const char* path, const struct stat*, int, struct FTW*) {
          (void)::remove(path);
          return 0;
        },
        16, FTW_DEPTH | FTW_PHYS);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

int parse_int_variable(const std::string& name, const std::string& value, int min_value) {
  size_t used = 0;
  long parsed = 0;
  try {
    parsed = std::stol(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (value.empty() || used != value.size() || parsed < min_value || parsed > 1'000'000'000) {
    throw std::invalid_argument("environment variable " + name + "='" + value +
                                "' is not an integer >= " + std::to_string(min_value));
  }
  return static_cast<int>(parsed);
}

const std::string* find(const std::map<std::string, std::string>& env, const std::string& key) {
  const auto it = env.find(key);
  return it == env.end() ? nullptr : &it->second;
}

int parse_port(const std::map<std::string, std::string>& env) {
  const std::string* port = find(env, "MASTER_PORT");
  if (port == nullptr) return 11868;
  const int value = parse_int_variable("MASTER_PORT", *port, 1);
  if (value > 65535) {
    throw std::invalid_argument("environment variable MASTER_PORT='" + *port +
                                "' is not a TCP port (1..65535)");
  }
  return value;
}

void check_rank(const WorkerEnv& w, const std::string& rank_var, const std::string& size_var) {
  if (w.rank >= w.world_size) {
    throw std::invalid_argument("environment variable " + rank_var + "=" +
                                std::to_string(w.rank) + " is not below " + size_var + "=" +
                                std::to_string(w.world_size));
  }
}

std::string signal_name(int sig) {
  switch (sig) {
    case SIGKILL: return "SIGKILL";
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGSEGV: return "SIGSEGV";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGHUP: return "SIGHUP";
    case SIGPIPE: return "SIGPIPE";
    case SIGSTOP: return "SIGSTOP";
    case SIGTSTP: return "SIGTSTP";
    case SIGTTIN: return "SIGTTIN";
    case SIGTTOU: return "SIGTTOU";
    default: {
      const char* text = strsignal(sig);
      return text != nullptr ? text : "unknown";
    }
  }
}

// A worker's wait status as a shell reports it: its exit status, or 128 + the signal that killed it.
int exit_code_of(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

std::string describe_exit(int rank, int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "rank " + std::to_string(rank) + " was killed by signal " + std::to_string(sig) + " (" +
           signal_name(sig) + ")";
  }
  return "rank " + std::to_string(rank) + " exited with status " +
         std::to_string(WEXITSTATUS(status));
}

volatile sig_atomic_t g_launcher_signal = 0;  // set by the handler only; read by run_workers
extern "C" void on_launcher_signal(int sig) { g_launcher_signal = sig; }

// Installs SIGINT/SIGTERM handlers for the launch and restores the previous ones afterwards.
class ScopedStopSignals {
 public:
  ScopedStopSignals() {
    g_launcher_signal = 0;
    struct sigaction action {};
    action.sa_handler = on_launcher_signal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~ScopedStopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

// Where the workers' lines go (LaunchOptions::sink).
using LineSink = std::function<void(int slot, bool is_stderr, const std::string& line)>;

struct Stream {
  int fd = -1;
  std::string pending;  // bytes after the last newline
};

using Clock = std::chrono::steady_clock;

struct Worker {
  pid_t pid = -1;
  bool running = false;  // started and not reaped yet
  int status = 0;
  Stream out, err;
  std::optional<Clock::time_point> stopped_since;  // stopped by a signal (SIGSTOP, SIGTSTP, ...)
  int stop_signal = 0;
  std::optional<Clock::time_point> left_early;  // exited 0 while others were still running
};

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// Both ends of a pipe; whatever is still open is closed on destruction.
struct PipeEnds {
  int read = -1, write = -1;
  PipeEnds() = default;
  PipeEnds(const PipeEnds&) = delete;
  PipeEnds& operator=(const PipeEnds&) = delete;
  ~PipeEnds() {
    close_fd(read);
    close_fd(write);
  }
};

// The launched workers and everything of theirs the launcher holds. One owner for every path out
// of run_workers, exceptions included: its destructor SIGKILLs the process group and the process
// of every worker not yet reaped, reaps them, and closes their pipes, so no worker, zombie or
// descriptor outlives the launch.
class WorkerGroup {
 public:
  explicit WorkerGroup(int world_size) : workers_(static_cast<size_t>(world_size)) {}
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;
  ~WorkerGroup() {
    signal_running(SIGKILL);
    for (Worker& w : workers_) {
      if (w.running) {
        while (::waitpid(w.pid, &w.status, 0) < 0 && errno == EINTR) {
        }
        w.running = false;
      }
      close_fd(w.out.fd);
      close_fd(w.err.fd);
    }
  }

  Worker& operator[](int rank) { return workers_[static_cast<size_t>(rank)]; }
  std::vector<Worker>& all() { return workers_; }
  int size() const { return static_cast<int>(workers_.size()); }
  // Whether any worker is started and not reaped yet.
  bool any_running() const {
    return std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; });
  }
  // A slot for one more worker (references to the others may move); its index.
  int add() {
    workers_.emplace_back();
    return size() - 1;
  }

  // Sends `sig` to the process group and the process of every worker not yet reaped. A worker's
  // id stays its own until it is reaped, so this never reaches a stranger.
  void signal_running(int sig) {
    for (Worker& w : workers_) {
      if (w.running) {
        ::kill(-w.pid, sig);  // the worker's process group: its own children too
        ::kill(w.pid, sig);
      }
    }
  }

  // Notes whether `w` was stopped or continued since the last call (consuming that news only, not
  // an exit).
  void note_stop_or_continue(Worker& w) {
    if (!w.running) return;
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(w.pid), &info, WSTOPPED | WCONTINUED | WNOHANG) != 0 || info.si_pid != w.pid) {
      return;
    }
    if (info.si_code == CLD_STOPPED) {
      w.stopped_since = Clock::now();
      w.stop_signal = info.si_status;
    } else if (info.si_code == CLD_CONTINUED) {
      w.stopped_since.reset();
    }
  }

  // When `w` has exited: SIGKILL to what it left in its process group while its id is still
  // reserved (the exited leader is not reaped yet), then reap it. Returns whether it was reaped.
  bool reap_if_exited(Worker& w) {
    if (!w.running) return false;
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(w.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid != w.pid) {
      return false;
    }
    ::kill(-w.pid, SIGKILL);
    while (::waitpid(w.pid, &w.status, 0) < 0 && errno == EINTR) {
    }
    w.running = false;
    return true;
  }

 private:
  std::vector<Worker> workers_;
};

// LaunchOptions::fail_system_call for the calls it names, else 0.
int injected_errno(const LaunchOptions& options, const char* call, int rank) {
  return options.fail_system_call ? options.fail_system_call(call, rank) : 0;
}

}  // namespace

std::optional<WorkerEnv> worker_env_from(const std::map<std::string, std::string>& env) {
  if (const std::string* rank = find(env, "RANK")) {
    WorkerEnv w;
    w.rank = parse_int_variable("RANK", *rank, 0);
    const std::string* world = find(env, "WORLD_SIZE");
    if (world == nullptr) {
      throw std::invalid_argument("environment variable RANK=" + *rank +
                                  " is set but WORLD_SIZE is not (torchrun sets both)");
    }
    w.world_size = parse_int_variable("WORLD_SIZE", *world, 1);
    const std::string* local = find(env, "LOCAL_RANK");
    w.local_rank = local != nullptr ? parse_int_variable("LOCAL_RANK", *local, 0) : w.rank;
    if (const std::string* addr = find(env, "MASTER_ADDR")) w.master_addr = *addr;
    w.master_port = parse_port(env);
    check_rank(w, "RANK", "WORLD_SIZE");
    if (const std::string* agent = find(env, "TORCHELASTIC_USE_AGENT_STORE")) {
      w.use_agent_store = *agent == "True" || *agent == "true" || *agent == "1";
    }
    if (const std::string* restarts = find(env, "TORCHELASTIC_RESTART_COUNT")) {
      w.restart_count = parse_int_variable("TORCHELASTIC_RESTART_COUNT", *restarts, 0);
    }
    return w;
  }
  if (const std::string* procid = find(env, "SLURM_PROCID")) {
    const std::string* ntasks = find(env, "SLURM_NTASKS");
    if (ntasks == nullptr) {
      throw std::invalid_argument("environment variable SLURM_PROCID=" + *procid +
                                  " is set but SLURM_NTASKS is not");
    }
    WorkerEnv w;
    w.rank = parse_int_variable("SLURM_PROCID", *procid, 0);
    w.world_size = parse_int_variable("SLURM_NTASKS", *ntasks, 1);
    const std::string* local = find(env, "SLURM_LOCALID");
    w.local_rank = local != nullptr ? parse_int_variable("SLURM_LOCALID", *local, 0) : 0;
    check_rank(w, "SLURM_PROCID", "SLURM_NTASKS");
    const std::string* addr = find(env, "MASTER_ADDR");
    if (addr == nullptr || addr->empty()) {
      if (w.world_size == 1) return std::nullopt;  // one task: a plain run inside an allocation
      throw std::invalid_argument(
          "Slurm started " + std::to_string(w.world_size) +
          " tasks (SLURM_NTASKS) but MASTER_ADDR is not set: export MASTER_ADDR=$(scontrol show "
          "hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) before srun");
    }
    w.master_addr = *addr;
    w.master_port = parse_port(env);
    return w;
  }
  return std::nullopt;
}

std::optional<WorkerEnv> worker_env_from_environment() {
  std::map<std::string, std::string> env;
  for (const char* key : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                          "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "TORCHELASTIC_USE_AGENT_STORE",
                          "TORCHELASTIC_RESTART_COUNT"}) {
    if (const char* value = std::getenv(key)) env[key] = value;
  }
  return worker_env_from(env);
}

std::string label_worker_line(int rank, const std::string& line) {
  if (line.rfind("[rank", 0) == 0) return line;
  for (const char* word : {"Rank ", "rank "}) {
    for (size_t at = line.find(word); at != std::string::npos; at = line.find(word, at + 1)) {
      const bool starts_word = at == 0 || !std::isalnum(static_cast<unsigned char>(line[at - 1]));
      const size_t digit = at + 5;
      if (starts_word && digit < line.size() &&
          std::isdigit(static_cast<unsigned char>(line[digit]))) {
        return line;
      }
    }
  }
  return "[rank " + std::to_string(rank) + "] " + line;
}

namespace {

constexpr const char* kAgentStoreVariable = "TORCHELASTIC_USE_AGENT_STORE";

// The rendezvous store the launcher serves (LaunchOptions::serve_store) for `world_size` workers.
// Its server thread runs until the store is let go; the sockets are close-on-exec, so the workers
// forked after it hold none of them.
c10::intrusive_ptr<c10d::TCPStore> serve_rendezvous_store(int master_port) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(master_port);
  options.isServer = true;
  options.waitWorkers = false;
  try {
    return c10::make_intrusive<c10d::TCPStore>("localhost", options);
  } catch (const std::exception& e) {
    throw std::runtime_error("--master_port " + std::to_string(master_port) +
                             ": the launcher could not serve the rendezvous store there (" + e.what() +
                             "); pass a free --master_port");
  }
}

// `options` for workers that connect to a store the launcher already serves.
LaunchOptions agent_store_workers(const LaunchOptions& options) {
  LaunchOptions out = options;
  out.serve_store = false;
  out.extra_env.emplace_back(kAgentStoreVariable, "1");
  return out;
}

// Where a lost worker is recorded: the key the workers read through their attempt's prefix (as
// process_group.cpp's connect_store and c10d's PrefixStore form it).
std::string attempt_key(int restart_count, const std::string& key) {
  return "/worker/attempt_" + std::to_string(restart_count) + "/" + key;
}

// The workers' output, line by line, to `sink`, each line labelled with its rank (or launch id).
void emit_lines(const LineSink& sink, int slot, bool is_stderr, Stream& s, bool at_eof) {
  size_t start = 0;
  for (size_t nl = s.pending.find('\n'); nl != std::string::npos; nl = s.pending.find('\n', start)) {
    sink(slot, is_stderr, label_worker_line(slot, s.pending.substr(start, nl - start)));
    start = nl + 1;
  }
  s.pending.erase(0, start);
  if (at_eof && !s.pending.empty()) {
    sink(slot, is_stderr, label_worker_line(slot, s.pending));
    s.pending.clear();
  }
}

LineSink print_lines() {
  return [](int, bool is_stderr, const std::string& line) {
    FILE* out = is_stderr ? stderr : stdout;
    std::fwrite(line.data(), 1, line.size(), out);
    std::fputc('\n', out);
    std::fflush(out);
  };
}

// One run of the workers (run_workers): they are started, their output forwarded, and their
// exits watched until every one is reaped. A pass of the loop (run) reads what the pipes hold,
// watches each worker (stopped, exited, failed), keeps an elastic run's membership in the store,
// and starts replacements. The first failure (outside --elastic) stops the rest: SIGTERM, then
// SIGKILL after kill_grace. Workers are slots: the world's ranks first, then replacements, whose
// launch id is their slot.
class Launch {
 public:
  Launch(const std::vector<std::string>& argv_of_self, int world_size, const std::string& master_addr,
         int master_port, const LaunchOptions& options, c10d::Store* store)
      : world_size_(world_size),
        master_addr_(master_addr),
        master_port_(master_port),
        options_(options),
        store_(store),
        sink_(options.sink ? options.sink : print_lines()),
        workers_(world_size) {
    // Everything the children need is built before fork: after it only async-signal-safe calls.
    std::set<std::string> replaced = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TMPDIR"};
    for (const auto& kv : options.extra_env) replaced.insert(kv.first);
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      const std::string entry = *e;
      if (replaced.count(entry.substr(0, entry.find('='))) == 0) base_env_.push_back(entry);
    }
    for (const auto& [key, value] : options.extra_env) base_env_.push_back(key + "=" + value);
    if (std::none_of(options.extra_env.begin(), options.extra_env.end(), [](const auto& kv) { return kv.first == "TMPDIR"; })) {
      base_env_.push_back("TMPDIR=" + scratch_.path());
    }
    for (const auto& arg : argv_of_self) argv_.push_back(const_cast<char*>(arg.c_str()));
    argv_.push_back(nullptr);
  }

  LaunchResult run() {
    for (int rank = 0; rank < world_size_; ++rank) spawn(rank, rank);
    bool all_exited = false;
    Clock::time_point drain_deadline{};
    // Output still buffered in the pipes is read for a short while after the last exit; a
    // grandchild that keeps a pipe open must not keep the launcher waiting.
    while (!all_exited || (any_pipe_open() && Clock::now() <= drain_deadline)) {
      forward_output();
      if (g_launcher_signal != 0 && !stopping_) {
        const int sig = g_launcher_signal;
        begin_stop("the launcher received " + signal_name(sig) + "; stopped all ranks", 128 + sig);
        result_.interrupted = true;
      }
      to_replace_.clear();
      for (int slot = 0; slot < workers_.size(); ++slot) watch(slot);
      if (options_.elastic && !stopping_) keep_membership();
      start_replacements();
      if (stopping_ && Clock::now() >= kill_deadline_) workers_.signal_running(SIGKILL);
      if (!all_exited) {
        all_exited = !workers_.any_running();
        if (all_exited) drain_deadline = Clock::now() + std::chrono::seconds(2);
      }
    }
    return finish();
  }

 private:
  // Starts worker `slot` (its RANK and LOCAL_RANK `rank`; a replacement's slot is past the world,
  // and its launch id, `slot`, goes in kElasticJoinIdVariable).
  void spawn(int slot, int rank) {
    std::vector<std::string> env_strings = base_env_;
    env_strings.push_back("RANK=" + std::to_string(rank));
    env_strings.push_back("WORLD_SIZE=" + std::to_string(world_size_));
    env_strings.push_back("LOCAL_RANK=" + std::to_string(rank));
    env_strings.push_back("MASTER_ADDR=" + master_addr_);
    env_strings.push_back("MASTER_PORT=" + std::to_string(master_port_));
    if (slot != rank) env_strings.push_back(std::string(kElasticJoinIdVariable) + "=" + std::to_string(slot));
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);

    PipeEnds out_pipe, err_pipe;
    for (PipeEnds* ends : {&out_pipe, &err_pipe}) {
      int fds[2];
      int err = injected_errno(options_, "pipe2", slot);
      if (err == 0 && ::pipe2(fds, O_CLOEXEC) != 0) err = errno;
      if (err != 0) {
        throw std::runtime_error("launcher: pipe for rank " + std::to_string(slot) + " failed: " + std::strerror(err));
      }
      ends->read = fds[0];
      ends->write = fds[1];
    }
    int fork_error = injected_errno(options_, "fork", slot);
    const pid_t pid = fork_error != 0 ? -1 : ::fork();
    if (pid < 0) {
      if (fork_error == 0) fork_error = errno;
      throw std::runtime_error("launcher: fork of rank " + std::to_string(slot) + " failed: " + std::strerror(fork_error));
    }
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::signal(SIGPIPE, SIG_DFL);  // as a shell would start it, whatever this process ignores
      if (::getppid() != launcher_pid_) ::_exit(125);  // the launcher is already gone
      ::dup2(out_pipe.write, STDOUT_FILENO);
      ::dup2(err_pipe.write, STDERR_FILENO);
      ::execve(options_.executable.c_str(), argv_.data(), envp.data());
      const char msg[] = "launcher: exec of the worker program failed\n";
      (void)!::write(STDERR_FILENO, msg, sizeof(msg) - 1);
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here, so that kill(-pid) works before the child runs
    Worker& w = workers_[slot];
    w.pid = pid;
    w.running = true;
    std::swap(w.out.fd, out_pipe.read);
    std::swap(w.err.fd, err_pipe.read);
    result_.pids.push_back(pid);
  }

  bool any_pipe_open() {
    return std::any_of(workers_.all().begin(), workers_.all().end(),
                       [](const Worker& w) { return w.out.fd >= 0 || w.err.fd >= 0; });
  }

  // Waits up to 50 ms for output, then forwards every whole line read.
  void forward_output() {
    std::vector<pollfd> fds;
    std::vector<std::pair<int, bool>> owners;  // (slot, is_stderr) of each pollfd
    for (int slot = 0; slot < workers_.size(); ++slot) {
      Worker& w = workers_[slot];
      if (w.out.fd >= 0) {
        fds.push_back({w.out.fd, POLLIN, 0});
        owners.emplace_back(slot, false);
      }
      if (w.err.fd >= 0) {
        fds.push_back({w.err.fd, POLLIN, 0});
        owners.emplace_back(slot, true);
      }
    }
    if (fds.empty()) {
      ::usleep(20'000);
      return;
    }
    ::poll(fds.data(), fds.size(), 50);
    for (size_t k = 0; k < fds.size(); ++k) {
      if ((fds[k].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const auto [slot, is_stderr] = owners[k];
      Stream& s = is_stderr ? workers_[slot].err : workers_[slot].out;
      char buffer[65536];
      const ssize_t n = ::read(s.fd, buffer, sizeof(buffer));
      if (n > 0) {
        s.pending.append(buffer, static_cast<size_t>(n));
        emit_lines(sink_, slot, is_stderr, s, false);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        emit_lines(sink_, slot, is_stderr, s, true);
        close_fd(s.fd);
      }
    }
  }

  bool overdue(const std::optional<Clock::time_point>& since) const {
    return since && Clock::now() - *since > options_.unresponsive_worker_timeout;
  }

  // Worker `slot`'s news since the last pass: stopped or continued, stopped for too long, exited
  // (early, or failing).
  void watch(int slot) {
    Worker& w = workers_[slot];
    workers_.note_stop_or_continue(w);
    if (options_.elastic && !stopping_ && w.running && overdue(w.stopped_since) && declared_lost_.count(slot) == 0) {
      // Lost, but not killed: continued, it finds that its generation went on without it and
      // leaves with that reason (elastic_rendezvous.h). It is killed once the run is over.
      const auto limit = std::chrono::duration_cast<std::chrono::seconds>(options_.unresponsive_worker_timeout);
      declare_lost(slot,
                   "rank " + std::to_string(slot) + " was stopped by " + signal_name(w.stop_signal) +
                       " for more than " + std::to_string(limit.count()) + " s",
                   1);
    } else if (!options_.elastic && !stopping_ && ((w.running && overdue(w.stopped_since)) || overdue(w.left_early))) {
      begin_stop(suspects(), 1);
    }
    if (!workers_.reap_if_exited(w)) return;
    const int status = w.status;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && workers_.any_running()) {
      w.left_early = Clock::now();
    }
    const bool failed = WIFSIGNALED(status) || WEXITSTATUS(status) != 0;
    if (!failed || stopping_) return;
    if (!options_.elastic) {
      begin_stop(describe_exit(slot, status), exit_code_of(status));
    } else if (declared_lost_.count(slot) > 0) {
      std::fprintf(stderr, "launcher: %s (lost already)\n", describe_exit(slot, status).c_str());
      std::fflush(stderr);
    } else {
      declare_lost(slot, describe_exit(slot, status), exit_code_of(status));
    }
  }

  // A stopped rank, or one that exited 0 while the others still run, is the likely cause of
  // whatever fails next (the others time out waiting for it in a collective): the failure names it.
  std::string suspects() {
    std::string text;
    const auto seconds_since = [](Clock::time_point since) {
      char text[64];
      std::snprintf(text, sizeof(text), "%.1f", std::chrono::duration<double>(Clock::now() - since).count());
      return std::string(text);
    };
    for (int slot = 0; slot < workers_.size(); ++slot) {
      const Worker& w = workers_[slot];
      if (w.running && w.stopped_since) {
        text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(slot) + " was stopped by " +
                signal_name(w.stop_signal) + " " + seconds_since(*w.stopped_since) + " s ago and stopped answering";
      } else if (w.left_early) {
        text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(slot) + " exited with status 0 " +
                seconds_since(*w.left_early) + " s ago while the others kept running";
      }
    }
    return text;
  }

  void begin_stop(const std::string& why, int code) {
    if (stopping_) return;
    stopping_ = true;
    const std::string cause = suspects();
    result_.failure = cause.empty() || why == cause ? why : why + " (" + cause + ")";
    result_.exit_code = code;
    workers_.signal_running(SIGTERM);
    workers_.signal_running(SIGCONT);  // a stopped worker gets its SIGTERM too
    kill_deadline_ = Clock::now() + options_.kill_grace;
  }

  // Elastic: worker `slot` is recorded lost in the store, so that the others go on without it,
  // and a replacement may start for it.
  void declare_lost(int slot, const std::string& why, int code) {
    declared_lost_.insert(slot);
    result_.lost.push_back(slot);
    if (result_.exit_code == 0) result_.exit_code = code;
    result_.failure += (result_.failure.empty() ? "" : "; ") + why;
    std::fprintf(stderr, "launcher: %s; it is lost, the others go on (--elastic)\n", why.c_str());
    std::fflush(stderr);
    try {
      store_->set(attempt_key(options_.restart_count, lost_process_key(slot)), std::vector<uint8_t>(why.begin(), why.end()));
    } catch (const std::exception& e) {
      begin_stop(why + " (and the store could not record it: " + e.what() + ")", 1);
    }
    if (static_cast<int>(result_.replacements.size() + to_replace_.size() + awaiting_recovery_.size()) <
        options_.max_replacements) {
      (is_member(slot) ? awaiting_recovery_ : to_replace_).push_back(slot);
    }
  }

  // A world's rank, or a replacement the run admitted.
  bool is_member(int slot) {
    return slot < world_size_ || store_->check({attempt_key(options_.restart_count, admitted_key(slot))});
  }

  // Elastic: when no member is left (the run ended, or failed), replacements still waiting to join
  // are told through the store, and leave without training; workers declared lost that still run
  // (stopped, say) are killed. A lost member's replacement starts once the survivors committed a
  // step without it (recovered_key), so that a process's start does not share the machine with
  // their recovery; none starts for a run that ended.
  void keep_membership() {
    std::vector<int> waiting, leftovers;
    bool member_running = false;
    for (int slot = 0; slot < workers_.size() && !member_running; ++slot) {
      if (!workers_[slot].running) continue;
      if (declared_lost_.count(slot) > 0) {
        leftovers.push_back(slot);
      } else if (is_member(slot)) {
        member_running = true;
      } else {
        waiting.push_back(slot);
      }
    }
    if (!member_running && !waiting.empty() && !admissions_closed_) {
      admissions_closed_ = true;
      unneeded_.insert(waiting.begin(), waiting.end());
      store_->set(attempt_key(options_.restart_count, admissions_closed_key()), std::vector<uint8_t>{1});
    }
    for (auto it = awaiting_recovery_.begin(); it != awaiting_recovery_.end();) {
      const bool recovered = store_->check({attempt_key(options_.restart_count, recovered_key(*it))});
      if (recovered && member_running) to_replace_.push_back(*it);
      it = recovered || !member_running ? awaiting_recovery_.erase(it) : it + 1;
    }
    if (!member_running) {
      for (const int slot : leftovers) {
        ::kill(-workers_[slot].pid, SIGKILL);
        ::kill(workers_[slot].pid, SIGKILL);
      }
    }
  }

  // The replacement takes the lost worker's RANK and LOCAL_RANK (its device), and a launch id of
  // its own, past the world, to join under (elastic_rendezvous.h).
  void start_replacements() {
    for (const int lost : to_replace_) {
      if (stopping_) break;
      const int slot = workers_.add();
      const int rank = lost < world_size_ ? lost : result_.replacements.at(static_cast<size_t>(lost - world_size_)).rank;
      result_.replacements.push_back({slot, rank});
      std::fprintf(stderr, "launcher: starting rank %d as a replacement for rank %d (--elastic)\n", slot, lost);
      std::fflush(stderr);
      spawn(slot, rank);
    }
  }

  // Every worker is reaped here (its leftovers SIGKILLed before that); the group's destructor
  // closes the pipes.
  LaunchResult finish() {
    for (const Worker& w : workers_.all()) result_.wait_status.push_back(w.status);
    if (options_.elastic && !stopping_) {
      // The run went on without its lost workers: it succeeded when one of them finished it.
      // (A replacement that was never needed left with status 0 too: it finished nothing.)
      bool finished = false;
      for (int slot = 0; slot < workers_.size(); ++slot) {
        const int status = workers_[slot].status;
        finished = finished || (unneeded_.count(slot) == 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0);
      }
      if (finished) result_.exit_code = 0;
      if (!finished && result_.failure.empty()) result_.failure = "no worker finished";
    }
    return result_;
  }

  const int world_size_;
  const std::string master_addr_;
  const int master_port_;
  const LaunchOptions& options_;
  c10d::Store* const store_;  // elastic: where lost workers are recorded
  const LineSink sink_;
  const pid_t launcher_pid_ = ::getpid();
  // Destroyed in reverse: the workers are killed and reaped before the signal handlers go back
  // and before the scratch folder is removed.
  const ScratchFolder scratch_;
  std::vector<std::string> base_env_;  // every worker's environment but its own five variables
  std::vector<char*> argv_;
  ScopedStopSignals stop_signals_;
  LaunchResult result_;
  WorkerGroup workers_;

  bool stopping_ = false;
  Clock::time_point kill_deadline_{};
  // Elastic.
  std::set<int> declared_lost_;           // the workers recorded lost in the store
  std::vector<int> to_replace_;           // lost workers whose replacements start after this pass
  std::vector<int> awaiting_recovery_;    // lost members whose replacements wait for recovered_key
  bool admissions_closed_ = false;        // no member left to admit a waiting replacement
  std::set<int> unneeded_;                // the replacements that were waiting then
};

// run_workers, the store already served (by this launcher: `store`, where it records lost
// workers under elastic) or not (nullptr: rank 0 serves it).
LaunchResult run_workers_with_store(const std::vector<std::string>& argv_of_self, int world_size,
                                    const std::string& master_addr, int master_port, const LaunchOptions& options,
                                    c10d::Store* store) {
  if (options.elastic && store == nullptr) {
    throw std::invalid_argument("run_workers: elastic needs serve_store (the launcher records lost workers there)");
  }
  if (world_size < 1) {
    throw std::invalid_argument("--world_size " + std::to_string(world_size) + " must be at least 1");
  }
  if (argv_of_self.empty()) throw std::invalid_argument("run_workers: argv_of_self is empty");
  return Launch(argv_of_self, world_size, master_addr, master_port, options, store).run();
}

}  // namespace

LaunchResult run_workers(const std::vector<std::string>& argv_of_self, int world_size,
                         const std::string& master_addr, int master_port,
                         const LaunchOptions& options) {
  if (options.serve_store && world_size >= 1 && !argv_of_self.empty()) {
    const c10::intrusive_ptr<c10d::TCPStore> store = serve_rendezvous_store(master_port);
    return run_workers_with_store(argv_of_self, world_size, master_addr, master_port, agent_store_workers(options),
                                  store.get());
  }
  return run_workers_with_store(argv_of_self, world_size, master_addr, master_port, options, nullptr);
}

int launch_workers(const std::vector<std::string>& argv_of_self, int world_size,
                   const std::string& master_addr, int master_port) {
  const LaunchResult result = run_workers(argv_of_self, world_size, master_addr, master_port);
  if (result.exit_code != 0) std::fprintf(stderr, "launcher: %s\n", result.failure.c_str());
  return result.exit_code;
}

std::vector<std::string> with_resume_auto(const std::vector<std::string>& argv_of_self) {
  std::vector<std::string> out;
  for (size_t i = 0; i < argv_of_self.size(); ++i) {
    const std::string& a = argv_of_self[i];
    if (a == "--resume") {
      ++i;  // and its value
      continue;
    }
    if (a.rfind("--resume=", 0) == 0) continue;
    out.push_back(a);
  }
  out.push_back("--resume");
  out.push_back("auto");
  return out;
}

int launch_with_restarts(const std::vector<std::string>& argv_of_self, int world_size,
                         const std::string& master_addr, int master_port, int max_restarts,
                         const LaunchOptions& options) {
  if (max_restarts < 0) {
    throw std::invalid_argument("--max_restarts must be >= 0, got " + std::to_string(max_restarts));
  }
  std::vector<std::string> args = argv_of_self;
  c10::intrusive_ptr<c10d::TCPStore> store;  // one for every attempt, where the launcher serves it
  if (options.serve_store) store = serve_rendezvous_store(master_port);
  for (int restart = 0;; ++restart) {
    LaunchOptions attempt = options.serve_store ? agent_store_workers(options) : options;
    attempt.restart_count = restart;
    attempt.extra_env.emplace_back("TORCHELASTIC_RESTART_COUNT", std::to_string(restart));
    attempt.extra_env.emplace_back("TORCHELASTIC_MAX_RESTARTS", std::to_string(max_restarts));
    const LaunchResult result = run_workers_with_store(args, world_size, master_addr, master_port, attempt, store.get());
    if (result.exit_code == 0) return 0;
    std::fprintf(stderr, "launcher: %s\n", result.failure.c_str());
    if (result.interrupted || restart >= max_restarts) {
      if (max_restarts > 0 && !result.interrupted) {
        std::fprintf(stderr, "launcher: no restart left (--max_restarts %d); giving up\n", max_restarts);
      }
      return result.exit_code;
    }
    std::fprintf(stderr,
                 "launcher: restarting all %d workers (restart %d of %d); they resume from the "
                 "newest complete checkpoint (--resume auto)\n",
                 world_size, restart + 1, max_restarts);
    std::fflush(stderr);
    args = with_resume_auto(argv_of_self);
  }
}

}  // namespace harness::data_parallel
