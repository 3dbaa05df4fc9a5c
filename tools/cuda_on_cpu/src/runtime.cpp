// The CPU execution layer: fibers for CUDA threads, warp collectives, block barriers, launches, and
// the CUDA runtime calls our launchers make.
#include "cuda_on_cpu/runtime.h"

#include "fiber.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

namespace emu {

// Launches run one at a time (g_launch_mutex), so the scheduler's state is plain globals: a
// thread_local in a shared library costs a __tls_get_addr call on every threadIdx.
ThreadState* g_thread = nullptr;

namespace {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;
constexpr size_t kDefaultSmem = 48 * 1024;  // without cudaFuncSetAttribute opt-in
#if EMU_ASAN
constexpr size_t kStackBytes = 1024 * 1024;
#else
constexpr size_t kStackBytes = 256 * 1024;
#endif

const char* coll_name(Coll op) {
  switch (op) {
    case Coll::kShflIdx: return "__shfl_sync";
    case Coll::kShflUp: return "__shfl_up_sync";
    case Coll::kShflDown: return "__shfl_down_sync";
    case Coll::kShflXor: return "__shfl_xor_sync";
    case Coll::kBallot: return "__ballot_sync";
    case Coll::kAny: return "__any_sync";
    case Coll::kAll: return "__all_sync";
    case Coll::kMatchAny: return "__match_any_sync";
    case Coll::kMatchAll: return "__match_all_sync";
    case Coll::kReduceAdd: return "__reduce_add_sync";
    case Coll::kReduceMin: return "__reduce_min_sync";
    case Coll::kReduceMax: return "__reduce_max_sync";
    case Coll::kReduceAnd: return "__reduce_and_sync";
    case Coll::kReduceOr: return "__reduce_or_sync";
    case Coll::kReduceXor: return "__reduce_xor_sync";
    case Coll::kSyncWarp: return "__syncwarp";
  }
  return "?";
}

std::string hex(unsigned m) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", m);
  return buf;
}

std::string where(const char* file, int line) { return std::string(file ? file : "?") + ":" + std::to_string(line); }

enum class Run { kRunnable, kBarrier, kCollective, kDone };

struct Fiber {
  Context ctx;
  char* stack = nullptr;  // usable stack above one PROT_NONE guard page
};

// A cp.async in flight: its source bytes, read at the issue, and the commit group it belongs to (the number of
// the thread's commits before it).
struct AsyncCopy {
  unsigned char* dst;
  unsigned char data[16];
  int bytes;
  int64_t group;
};

struct Thread {
  ThreadState st;
  Run run = Run::kRunnable;
  Fiber fiber;
  std::vector<AsyncCopy> copies;  // cp.async in flight, oldest first
  int64_t commits = 0;
  // Where the thread waits (barrier or collective), for messages.
  const char* file = nullptr;
  int line = 0;
  // Its part in a pending collective, and the result written when the collective completes.
  CollArgs coll{};
  unsigned char value[16];
  unsigned char result[16];
  int pred_result = 0;
  int barrier_pred = 0;
  int barrier_result = 0;
};

struct PendingColl {
  unsigned mask;
  unsigned arrived;
  Coll op;
  int width;
  int size;
};

struct Warp {
  unsigned exited = 0;  // lanes that have exited (or do not exist: a partial last warp)
  std::vector<PendingColl> pending;
};

struct Block {
  const LaunchConfig* cfg = nullptr;
  const std::function<void()>* body = nullptr;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  int live = 0;
  int at_barrier = 0;
  void* smem = nullptr;
  std::string error;  // set when a thread fails: the launch stops and raises
};

// The scheduler's context and the running block (one launch at a time).
Context t_sched;
#if EMU_ASAN
const void* t_sched_bottom = nullptr;  // the scheduler's stack, for ASan's fiber switches
size_t t_sched_size = 0;
#endif
Block* t_block = nullptr;
Thread* t_running = nullptr;

// Fiber stacks are reused across launches; launches from several OS threads run one at a time
// (static __shared__ variables are process-wide).
std::mutex g_launch_mutex;
std::vector<char*> g_stacks;
// Stacks whose last fiber was abandoned mid-kernel (a reported error): ASan's redzones of its frames
// are still poisoned, so the next fiber on it starts from a cleared shadow. A fiber that ends normally
// has unwound every frame but its entry function's, which the next fiber lays out identically.
std::vector<bool> g_stack_dirty;
uint64_t g_block_epoch = 0;
// Set when a barrier releases the block: a thread of another warp than the running one became runnable.
bool g_released = false;

size_t page_size() {
  static const size_t p = size_t(sysconf(_SC_PAGESIZE));
  return p;
}

char* stack_for(size_t i) {
  while (g_stacks.size() <= i) {
    const size_t guard = page_size();
    void* p = mmap(nullptr, kStackBytes + guard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("cuda_on_cpu: cannot map a fiber stack");
    mprotect(p, guard, PROT_NONE);  // a fiber that overflows its stack faults instead of corrupting
    g_stacks.push_back(static_cast<char*>(p) + guard);
    g_stack_dirty.push_back(false);
  }
  return g_stacks[i];
}

std::string thread_name(const Block& b, const Thread& t) {
  std::ostringstream s;
  s << "kernel " << b.cfg->kernel << ", block (" << t.st.block_idx.x << "," << t.st.block_idx.y << ","
    << t.st.block_idx.z << "), warp " << t.st.warp << ", lane " << t.st.lane << " (thread " << t.st.thread_idx.x << ","
    << t.st.thread_idx.y << "," << t.st.thread_idx.z << ")";
  return s.str();
}

// Switch from the running fiber back to the scheduler.
void yield_to_scheduler(bool finished) {
  Thread* t = t_running;
#if EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(finished ? nullptr : &fake, t_sched_bottom, t_sched_size);
#endif
  switch_context(t->fiber.ctx, t_sched);
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  (void)finished;
}

[[noreturn]] void abort_block(const std::string& msg) {
  Block* b = t_block;
  if (b->error.empty()) b->error = msg;
  // The fiber never resumes; its stack is simply reused by a later launch.
  yield_to_scheduler(true);
  std::abort();  // unreachable
}

void fiber_entry() {
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  Block* b = t_block;
  Thread* t = t_running;
  try {
    (*b->body)();
  } catch (const std::exception& e) {
    if (b->error.empty()) b->error = thread_name(*b, *t) + ": C++ exception in the kernel: " + e.what();
  }
  t->run = Run::kDone;
  yield_to_scheduler(true);
}

}  // namespace

[[noreturn]] void fail(const std::string& what, const char* file, int line) {
  Block* b = t_block;
  if (b == nullptr || t_running == nullptr) throw std::runtime_error("cuda_on_cpu: " + what + " outside a kernel");
  abort_block(thread_name(*b, *t_running) + ": " + what + " at " + where(file, line));
}

void* dynamic_shared() { return t_block->smem; }

void cp_async(void* dst, const void* src, int bytes, const char* file, int line) {
  if (t_running == nullptr) throw std::runtime_error("cuda_on_cpu: cp.async outside a kernel");
  if (bytes != 4 && bytes != 8 && bytes != 16) fail("cp.async of " + std::to_string(bytes) + " bytes", file, line);
  if (reinterpret_cast<uintptr_t>(dst) % unsigned(bytes) || reinterpret_cast<uintptr_t>(src) % unsigned(bytes)) {
    fail("cp.async of " + std::to_string(bytes) + " bytes from or to an address off " + std::to_string(bytes) +
             " bytes",
         file, line);
  }
  AsyncCopy c{static_cast<unsigned char*>(dst), {}, bytes, t_running->commits};
  std::memcpy(c.data, src, size_t(bytes));
  std::memset(dst, 0xff, size_t(bytes));  // undefined until the copy completes
  t_running->copies.push_back(c);
}

void cp_async_commit() {
  if (t_running == nullptr) throw std::runtime_error("cuda_on_cpu: cp.async.commit_group outside a kernel");
  ++t_running->commits;
}

namespace {
// Completes the thread's copies of the groups before `group`.
void complete_copies(Thread& t, int64_t group) {
  size_t done = 0;
  while (done < t.copies.size() && t.copies[done].group < group) {
    const AsyncCopy& c = t.copies[done++];
    std::memcpy(c.dst, c.data, size_t(c.bytes));
  }
  t.copies.erase(t.copies.begin(), t.copies.begin() + std::ptrdiff_t(done));
}
}  // namespace

void cp_async_wait(int pending) {
  if (t_running == nullptr) throw std::runtime_error("cuda_on_cpu: cp.async.wait_group outside a kernel");
  complete_copies(*t_running, t_running->commits - pending);
}

namespace {
std::mutex g_attr_mutex;
std::map<const void*, int> g_max_dynamic_smem;
}  // namespace

void set_max_dynamic_smem(const void* func, int bytes) {
  std::lock_guard<std::mutex> lock(g_attr_mutex);
  g_max_dynamic_smem[func] = bytes;
}

void shared_declared(void* p, size_t bytes, uint64_t* epoch) {
  if (*epoch != g_block_epoch) {
    std::memset(p, 0xff, bytes);
    *epoch = g_block_epoch;
  }
}

unsigned active_lanes() {
  const Thread& t = *t_running;
  return ~t_block->warps[t.st.warp].exited;
}

namespace {

void release_barrier(Block& b) {
  g_released = true;
  int count = 0;
  for (auto& t : b.threads)
    if (t.run == Run::kBarrier) count += t.barrier_pred;
  for (auto& t : b.threads) {
    if (t.run == Run::kBarrier) {
      t.run = Run::kRunnable;
      t.barrier_result = count;
    }
  }
  b.at_barrier = 0;
}

void resolve(Block& b, int warp, const PendingColl& g) {
  Thread* lanes = &b.threads[size_t(warp) * kWarp];
  auto lane_of = [&](int l) -> Thread& { return lanes[l]; };
  uint32_t vals[kWarp] = {};
  for (int l = 0; l < kWarp; ++l) {
    if (g.mask >> l & 1u) std::memcpy(&vals[l], lane_of(l).value, 4);
  }
  unsigned ballot = 0;
  for (int l = 0; l < kWarp; ++l)
    if ((g.mask >> l & 1u) && vals[l]) ballot |= 1u << l;
  // __reduce_*_sync: one value for every lane.
  uint32_t reduced = 0;
  if (g.op >= Coll::kReduceAdd && g.op <= Coll::kReduceXor) {
    const bool is_signed = lane_of(__builtin_ctz(g.mask)).coll.arg != 0;
    bool first = true;
    for (int o = 0; o < kWarp; ++o) {
      if (!(g.mask >> o & 1u)) continue;
      const uint32_t v = vals[o];
      if (first) {
        reduced = v;
        first = false;
        continue;
      }
      switch (g.op) {
        case Coll::kReduceAdd: reduced += v; break;
        case Coll::kReduceMin: reduced = (is_signed ? int32_t(v) < int32_t(reduced) : v < reduced) ? v : reduced; break;
        case Coll::kReduceMax: reduced = (is_signed ? int32_t(v) > int32_t(reduced) : v > reduced) ? v : reduced; break;
        case Coll::kReduceAnd: reduced &= v; break;
        case Coll::kReduceOr: reduced |= v; break;
        default: reduced ^= v; break;
      }
    }
  }

  for (int l = 0; l < kWarp; ++l) {
    if (!(g.mask >> l & 1u)) continue;
    Thread& t = lane_of(l);
    unsigned out = 0;
    switch (g.op) {
      case Coll::kShflIdx:
      case Coll::kShflUp:
      case Coll::kShflDown:
      case Coll::kShflXor: {
        // PTX shfl.sync: segments of `width` lanes; a source outside the segment's bounds reads itself.
        const int seg = kWarp - g.width;  // c[12:8]
        const int segmask = seg & 31;
        const int clamp = g.op == Coll::kShflUp ? 0 : 31;
        const int max_lane = (l & segmask) | (clamp & ~segmask);
        const int min_lane = l & segmask;
        const int bval = t.coll.arg & 31;
        int j = l;
        bool ok = false;
        switch (g.op) {
          case Coll::kShflUp: j = l - bval; ok = j >= max_lane; break;
          case Coll::kShflDown: j = l + bval; ok = j <= max_lane; break;
          case Coll::kShflXor: j = l ^ bval; ok = j <= max_lane; break;
          default: j = min_lane | (bval & ~segmask); ok = j <= max_lane; break;
        }
        if (!ok) j = l;
        if (!(g.mask >> j & 1u)) {
          b.error = thread_name(b, t) + ": " + coll_name(g.op) + " reads lane " + std::to_string(j) +
                    ", outside its mask " + hex(g.mask) + " at " + where(t.coll.file, t.coll.line);
          return;
        }
        std::memcpy(t.result, lane_of(j).value, size_t(g.size));
        t.run = Run::kRunnable;
        continue;
      }
      case Coll::kBallot: out = ballot; break;
      case Coll::kAny: out = ballot != 0; break;
      case Coll::kAll: out = ballot == g.mask; break;
      case Coll::kMatchAny:
      case Coll::kMatchAll: {
        unsigned same = 0;
        for (int o = 0; o < kWarp; ++o)
          if ((g.mask >> o & 1u) && std::memcmp(lane_of(o).value, t.value, size_t(g.size)) == 0) same |= 1u << o;
        if (g.op == Coll::kMatchAny) {
          out = same;
        } else {
          t.pred_result = same == g.mask;
          out = same == g.mask ? g.mask : 0u;
        }
        break;
      }
      case Coll::kReduceAdd:
      case Coll::kReduceMin:
      case Coll::kReduceMax:
      case Coll::kReduceAnd:
      case Coll::kReduceOr:
      case Coll::kReduceXor: out = reduced; break;
      case Coll::kSyncWarp: break;
    }
    std::memcpy(t.result, &out, 4);
    t.run = Run::kRunnable;
  }
}

}  // namespace

namespace {

// The running pytest test's name (PYTEST_CURRENT_TEST without its " (call)" phase); empty outside pytest.
std::string running_test() {
  const char* cur = std::getenv("PYTEST_CURRENT_TEST");
  std::string name = cur ? cur : "";
  const size_t phase = name.rfind(" (");
  if (phase != std::string::npos) name.resize(phase);
  return name;
}

// Barrier sites, for scripts/barrier_check.py (test tooling only).
// MOE_KERNELS_EMU_SKIP_SYNC=FILE:LINE: the __syncthreads or __syncwarp at that site (FILE a suffix of its
// source path) does nothing, as if deleted. MOE_KERNELS_EMU_SYNC_LOG=FILE appends "FILE:LINE<TAB>TEST" the
// first time each test (PYTEST_CURRENT_TEST at the launch) reaches each barrier site, skipped or not.
struct SyncSites {
  std::string skip_file;
  int skip_line = -1;
  const char* log = nullptr;
  std::string test;
  uint64_t test_version = 0;
  std::map<std::pair<const char*, int>, uint64_t> logged;  // site -> the test version it was last logged for

  SyncSites() {
    if (const char* skip = std::getenv("MOE_KERNELS_EMU_SKIP_SYNC")) {
      const std::string spec = skip;
      const size_t colon = spec.rfind(':');
      if (colon == std::string::npos || colon == 0 || colon + 1 == spec.size()) {
        std::fprintf(stderr, "cuda_on_cpu: MOE_KERNELS_EMU_SKIP_SYNC='%s' is not FILE:LINE\n", skip);
        std::abort();
      }
      skip_file = spec.substr(0, colon);
      skip_line = std::atoi(spec.c_str() + colon + 1);
    }
    log = std::getenv("MOE_KERNELS_EMU_SYNC_LOG");
    if (log != nullptr && *log == 0) log = nullptr;
  }

  // At each launch: the running test.
  void launch() {
    if (log == nullptr) return;
    std::string name = running_test();
    if (name.empty()) name = "?";
    if (name != test) {
      test = name;
      ++test_version;
    }
  }

  // Whether the barrier at file:line is skipped; logs the site.
  bool skipped(const char* file, int line) {
    if (log != nullptr) {
      uint64_t& v = logged[{file, line}];
      if (v != test_version) {
        v = test_version;
        if (FILE* f = std::fopen(log, "a")) {
          std::fprintf(f, "%s:%d\t%s\n", file ? file : "?", line, test.c_str());
          std::fclose(f);
        }
      }
    }
    if (line != skip_line || file == nullptr) return false;
    const size_t n = std::strlen(file);
    return n >= skip_file.size() && std::strcmp(file + n - skip_file.size(), skip_file.c_str()) == 0 &&
           (n == skip_file.size() || file[n - skip_file.size() - 1] == '/');
  }
};

SyncSites g_sync_sites;

}  // namespace

void warp_collective(const CollArgs& a, void* out, int* pred) {
  if (a.op == Coll::kSyncWarp && g_sync_sites.skipped(a.file, a.line)) return;
  Block& b = *t_block;
  Thread& t = *t_running;
  const int lane = t.st.lane;
  Warp& w = b.warps[size_t(t.st.warp)];
  const char* name = coll_name(a.op);
  if (!(a.mask >> lane & 1u)) fail(std::string(name) + " with mask " + hex(a.mask) + " that does not name the calling lane", a.file, a.line);
  if (a.mask & w.exited) {
    fail(std::string(name) + " with mask " + hex(a.mask) + " names lane(s) " + hex(a.mask & w.exited) +
             " that have exited (or do not exist)", a.file, a.line);
  }
  // Lanes join the pending collective of the same kind and mask. Lanes of one warp may wait in
  // different collectives at once (a half-warp shuffle while the other half waits in __syncwarp);
  // only when nothing can run any more is a mismatch an error (the deadlock report names it).
  PendingColl* g = nullptr;
  for (auto& p : w.pending) {
    if (p.mask == a.mask && p.op == a.op && p.width == a.width && p.size == a.size) {
      g = &p;
      break;
    }
  }
  if (g == nullptr) {
    w.pending.push_back(PendingColl{a.mask, 0u, a.op, a.width, a.size});
    g = &w.pending.back();
  }
  t.coll = a;
  t.file = a.file;
  t.line = a.line;
  std::memset(t.value, 0, sizeof t.value);
  std::memcpy(t.value, a.value, size_t(a.size));
  g->arrived |= 1u << lane;
  t.run = Run::kCollective;
  if (g->arrived == g->mask) {
    const PendingColl done = *g;
    w.pending.erase(w.pending.begin() + (g - w.pending.data()));
    resolve(b, t.st.warp, done);
    if (!b.error.empty()) abort_block(b.error);
  } else {
    yield_to_scheduler(false);
  }
  if (!b.error.empty()) abort_block(b.error);
  std::memcpy(out, t.result, size_t(a.op <= Coll::kShflXor ? a.size : 4));
  if (pred) *pred = t.pred_result;
}

int block_barrier(int pred, const char* file, int line) {
  if (g_sync_sites.skipped(file, line)) return pred;
  Block& b = *t_block;
  Thread& t = *t_running;
  t.run = Run::kBarrier;
  t.file = file;
  t.line = line;
  t.barrier_pred = pred;
  if (++b.at_barrier == b.live) {
    release_barrier(b);
  } else {
    yield_to_scheduler(false);
  }
  if (!b.error.empty()) abort_block(b.error);
  return t.barrier_result;
}

namespace {

void thread_exited(Block& b, Thread& t) {
  --b.live;
  Warp& w = b.warps[size_t(t.st.warp)];
  w.exited |= 1u << t.st.lane;
  for (const auto& p : w.pending) {
    if (p.mask >> t.st.lane & 1u) {
      const int waiting = __builtin_ctz(p.arrived);
      const Thread& o = b.threads[size_t(t.st.warp) * kWarp + size_t(waiting)];
      b.error = thread_name(b, t) + ": exited while lane " + std::to_string(waiting) + " waits for it in " +
                coll_name(p.op) + " (mask " + hex(p.mask) + ") at " + where(o.coll.file, o.coll.line);
      return;
    }
  }
  if (b.at_barrier > 0 && b.at_barrier == b.live) release_barrier(b);
}

// Waiting lanes whose collectives can never complete because lanes of one mask wait in another
// collective (or at __syncthreads): the message for the deadlock that results.
std::string mismatch(const Block& b) {
  for (size_t wi = 0; wi < b.warps.size(); ++wi) {
    const Warp& w = b.warps[wi];
    for (const auto& p : w.pending) {
      for (int l = 0; l < kWarp; ++l) {
        if (!(p.mask >> l & 1u) || (p.arrived >> l & 1u)) continue;
        const Thread& other = b.threads[wi * kWarp + size_t(l)];
        const Thread& waiting = b.threads[wi * kWarp + size_t(__builtin_ctz(p.arrived))];
        if (other.run != Run::kCollective && other.run != Run::kBarrier) continue;
        const std::string where_other = other.run == Run::kBarrier
                                            ? std::string("__syncthreads")
                                            : std::string(coll_name(other.coll.op)) + " (mask " + hex(other.coll.mask) +
                                                  ", width " + std::to_string(other.coll.width) + ")";
        return thread_name(b, waiting) + ": waits in " + coll_name(p.op) + " (mask " + hex(p.mask) + ", width " +
               std::to_string(p.width) + ") at " + where(waiting.coll.file, waiting.coll.line) + " for lane " +
               std::to_string(l) + ", which waits in " + where_other + " at " + where(other.file, other.line) +
               ": lanes of one mask in different collectives";
      }
    }
  }
  return "";
}

std::string deadlock_report(const Block& b) {
  std::ostringstream s;
  const Thread& first = b.threads.front();
  const std::string why = mismatch(b);
  if (!why.empty()) s << why << "\n  ";
  s << "kernel " << b.cfg->kernel << ", block (" << first.st.block_idx.x << "," << first.st.block_idx.y << ","
    << first.st.block_idx.z << ") deadlocked:";
  int shown = 0;
  for (const auto& t : b.threads) {
    if (t.run == Run::kDone) continue;
    if (shown++ == 8) {
      s << " ...";
      break;
    }
    s << "\n  warp " << t.st.warp << ", lane " << t.st.lane << " waits in "
      << (t.run == Run::kBarrier ? "__syncthreads" : coll_name(t.coll.op));
    if (t.run == Run::kCollective) s << " (mask " << hex(t.coll.mask) << ")";
    s << " at " << where(t.file, t.line);
  }
  return s.str();
}

cudaError_t g_last_error = cudaSuccess;

bool config_ok(const LaunchConfig& c, std::string& why) {
  const uint64_t threads = uint64_t(c.block.x) * c.block.y * c.block.z;
  if (threads == 0 || threads > kMaxThreads || c.block.x > 1024 || c.block.y > 1024 || c.block.z > 64) {
    why = "block (" + std::to_string(c.block.x) + "," + std::to_string(c.block.y) + "," + std::to_string(c.block.z) + ")";
    return false;
  }
  if (c.grid.x == 0 || c.grid.y == 0 || c.grid.z == 0 || c.grid.x > 0x7fffffffu || c.grid.y > 65535 ||
      c.grid.z > 65535) {
    why = "grid (" + std::to_string(c.grid.x) + "," + std::to_string(c.grid.y) + "," + std::to_string(c.grid.z) + ")";
    return false;
  }
  if (c.smem > kDefaultSmem) {
    std::lock_guard<std::mutex> lock(g_attr_mutex);
    const auto set = g_max_dynamic_smem.find(c.func);
    if (set == g_max_dynamic_smem.end() || size_t(set->second) < c.smem) {
      why = std::to_string(c.smem) + " bytes of dynamic shared memory (more than 48 KB needs cudaFuncSetAttribute "
            "with at least that much)";
      return false;
    }
  }
  return true;
}

bool g_verbose_errors = std::getenv("MOE_KERNELS_EMU_ABORT") != nullptr;
bool g_profile = std::getenv("MOE_KERNELS_EMU_PROFILE") != nullptr;

// The order in which blocks run and, between two synchronisation points, the order in which the runnable
// threads of a block run (MOE_KERNELS_EMU_SCHEDULE, or set_schedule). Every order is one a GPU may take: a
// kernel whose results depend on it has a race (a thread reading another's write without a barrier or a
// collective between them, a block reading another block's output). `forward` (the default) runs threads
// in rounds, each runnable thread once a round in index order, so a read of a lower thread's
// unsynchronised write goes unseen; `reverse` sees it; `random` shuffles the threads at every round and
// the blocks of every launch (an affine permutation: block (mul * i + add) mod n). Rounds keep warps in
// step at every collective, which hides a missing barrier between warps that also shuffle; the `serial-*`
// schedules run the first runnable thread (the lowest, the highest, or the first from a random start after
// each barrier) until it waits, so one warp runs ahead of the others to the next barrier.
enum class Order { kForward, kReverse, kRandom };
Order g_order = Order::kForward;
bool g_serial = false;  // serial-*: a thread runs on while it can, so a warp runs until it waits on others
uint64_t g_seed = 0;
uint64_t g_rng = 0;
std::string g_schedule = "forward";
std::string g_seeded_for;  // the test the generator last restarted for

uint64_t next_random() {  // splitmix64
  uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void parse_schedule(const std::string& full) {
  Order order;
  uint64_t seed = 0;
  const bool serial = full == "serial" || full.rfind("serial-", 0) == 0;
  const std::string spec = full == "serial" ? "forward" : serial ? full.substr(7) : full;
  if (serial && spec.empty()) {
    throw std::invalid_argument("cuda_on_cpu: schedule '" + full + "' names no order after serial-");
  } else if (spec.empty() || spec == "forward") {
    order = Order::kForward;
  } else if (spec == "reverse") {
    order = Order::kReverse;
  } else if (spec.rfind("random", 0) == 0 && (spec.size() == 6 || spec[6] == ':')) {
    order = Order::kRandom;
    if (spec.size() > 7) {
      const char* digits = spec.c_str() + 7;
      char* end = nullptr;
      errno = 0;
      seed = std::strtoull(digits, &end, 10);
      if (*digits < '0' || *digits > '9' || end == nullptr || *end != 0 || errno == ERANGE) {
        throw std::invalid_argument("cuda_on_cpu: bad schedule seed in '" + full + "'");
      }
    } else if (spec.size() == 7) {
      throw std::invalid_argument("cuda_on_cpu: bad schedule seed in '" + full + "'");
    }
  } else {
    throw std::invalid_argument("cuda_on_cpu: schedule '" + full +
                                "' is not one of forward, reverse, random, random:SEED, serial, serial-reverse, "
                                "serial-random, serial-random:SEED");
  }
  g_order = order;
  g_serial = serial;
  g_seed = seed;
  g_rng = seed;
  g_seeded_for.clear();
  g_schedule = full.empty() ? "forward" : full;
}

struct ScheduleFromEnv {
  ScheduleFromEnv() {
    const char* spec = std::getenv("MOE_KERNELS_EMU_SCHEDULE");
    if (spec == nullptr) return;
    try {
      parse_schedule(spec);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s (MOE_KERNELS_EMU_SCHEDULE)\n", e.what());
      std::abort();
    }
  }
} g_schedule_from_env;

// The random schedule restarts its generator from the seed and the running test's name whenever the
// test changes, so a test's orders do not depend on the tests that ran before it in the process.
void reseed_for_test() {
  std::string& last = g_seeded_for;
  const std::string name = running_test();
  if (name.empty() || name == last) return;
  last = name;
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  g_rng = g_seed ^ h;
}

uint64_t gcd(uint64_t a, uint64_t b) {
  while (b) {
    const uint64_t r = a % b;
    a = b;
    b = r;
  }
  return a;
}

// The blocks of a launch in schedule order: block `i` of the order is linear block (mul * i + add) % total,
// a permutation when gcd(mul, total) == 1 (no table, for grids of up to 2^31 * 65535^2 blocks).
struct BlockOrder {
  uint64_t total, mul = 1, add = 0;
  explicit BlockOrder(uint64_t n) : total(n) {
    if (g_order == Order::kReverse) {
      mul = n - 1;  // (n-1) * i + (n-1) == n-1-i (mod n)
      add = n - 1;
      if (n == 1) mul = 1;
    } else if (g_order == Order::kRandom && n > 1) {
      do {
        mul = next_random() % n;
      } while (mul == 0 || gcd(mul, n) != 1);
      add = next_random() % n;
    }
  }
  uint64_t operator[](uint64_t i) const {
    return uint64_t((unsigned __int128)mul * i % total + add) % total;
  }
};

// MOE_KERNELS_EMU_LAUNCH_LOG=FILE appends one line per distinct (kernel, block threads, dynamic shared
// bytes): the launch geometry that scripts/kernel_resources.py turns into occupancy.
void log_launch(const LaunchConfig& c) {
  static const char* path = std::getenv("MOE_KERNELS_EMU_LAUNCH_LOG");
  static std::set<std::string> seen;
  if (path == nullptr || *path == 0) return;
  const std::string line = std::string(c.kernel) + "\t" + std::to_string(c.block.x * c.block.y * c.block.z) + "\t" +
                           std::to_string(c.smem);
  if (!seen.insert(line).second) return;
  if (FILE* f = std::fopen(path, "a")) {
    std::fprintf(f, "%s\n", line.c_str());
    std::fclose(f);
  }
}


std::map<std::string, int64_t> g_kernel_launches;  // guarded by g_launch_mutex

}  // namespace

std::map<std::string, int64_t> kernel_launches() {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  return g_kernel_launches;
}

std::string set_schedule(const std::string& spec) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  const std::string before = g_schedule;
  parse_schedule(spec);
  return before;
}

void run_grid(const LaunchConfig& cfg, const std::function<void()>& body) {
  std::string why;
  if (!config_ok(cfg, why)) {
    g_last_error = cudaErrorInvalidConfiguration;
    if (g_verbose_errors) std::fprintf(stderr, "cuda_on_cpu: %s launch refused: %s\n", cfg.kernel, why.c_str());
    return;
  }
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  log_launch(cfg);
  const char* open = std::strchr(cfg.kernel, '<');
  ++g_kernel_launches[open ? std::string(cfg.kernel, open) : std::string(cfg.kernel)];
  g_sync_sites.launch();
  const auto t0 = std::chrono::steady_clock::now();
  struct Report {
    const LaunchConfig& cfg;
    std::chrono::steady_clock::time_point t0;
    ~Report() {
      if (!g_profile) return;
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "cuda_on_cpu: %-40s grid (%u,%u,%u) block (%u,%u,%u) smem %zu: %.2f ms\n", cfg.kernel,
                   cfg.grid.x, cfg.grid.y, cfg.grid.z, cfg.block.x, cfg.block.y, cfg.block.z, cfg.smem, ms);
    }
  } report{cfg, t0};
  const int n = int(cfg.block.x * cfg.block.y * cfg.block.z);
  const int nwarps = (n + kWarp - 1) / kWarp;
  Block b;
  b.cfg = &cfg;
  b.body = &body;
  b.threads.resize(size_t(nwarps) * kWarp);
  b.warps.resize(size_t(nwarps));
  for (int i = 0; i < n; ++i) stack_for(size_t(i));
#if EMU_ASAN
  {
    // The scheduler's own stack, which fibers switch back to.
    pthread_attr_t attr;
    void* addr = nullptr;
    size_t size = 0;
    pthread_getattr_np(pthread_self(), &attr);
    pthread_attr_getstack(&attr, &addr, &size);
    pthread_attr_destroy(&attr);
    t_sched_bottom = addr;
    t_sched_size = size;
  }
#endif
  Block* saved_block = t_block;
  Thread* saved_running = t_running;
  ThreadState* saved_thread = g_thread;
  t_block = &b;
  if (g_order == Order::kRandom) reseed_for_test();
  const uint64_t gx = cfg.grid.x, gy = cfg.grid.y;
  const BlockOrder blocks(gx * gy * cfg.grid.z);
  std::vector<int> order(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) order[size_t(i)] = g_order == Order::kReverse ? n - 1 - i : i;
  for (uint64_t bi = 0; bi < blocks.total; ++bi) {
    const uint64_t linear = blocks[bi];
    const unsigned bx = unsigned(linear % gx), by = unsigned(linear / gx % gy), bz = unsigned(linear / (gx * gy));
    ++g_block_epoch;
    b.live = n;
    b.at_barrier = 0;
    for (auto& w : b.warps) {
      w.pending.clear();
      w.exited = 0;
    }
    if (n % kWarp) b.warps.back().exited = ~0u << (n % kWarp);  // lanes past the block do not exist
    void* smem = nullptr;
    if (posix_memalign(&smem, 128, cfg.smem ? cfg.smem : 1) != 0) throw std::bad_alloc();
    std::memset(smem, 0xff, cfg.smem ? cfg.smem : 1);
    b.smem = cfg.smem ? smem : nullptr;
    for (int i = 0; i < n; ++i) {
      Thread& t = b.threads[size_t(i)];
      t.run = Run::kRunnable;
      t.copies.clear();
      t.commits = 0;
      t.st.block_idx = uint3{bx, by, bz};
      t.st.block_dim = cfg.block;
      t.st.grid_dim = cfg.grid;
      t.st.linear = i;
      t.st.thread_idx = uint3{unsigned(i) % cfg.block.x, (unsigned(i) / cfg.block.x) % cfg.block.y,
                              unsigned(i) / (cfg.block.x * cfg.block.y)};
      t.st.warp = i / kWarp;
      t.st.lane = i % kWarp;
      t.fiber.stack = stack_for(size_t(i));
#if EMU_ASAN
      if (g_stack_dirty[size_t(i)]) {
        __asan_unpoison_memory_region(t.fiber.stack, kStackBytes);
      } else {  // the entry frame's redzones, where make_context writes the first frame
        __asan_unpoison_memory_region(t.fiber.stack + kStackBytes - 4096, 4096);
      }
#endif
      g_stack_dirty[size_t(i)] = false;
      make_context(t.fiber.ctx, t.fiber.stack, kStackBytes, fiber_entry);
    }
    int done = 0;
    auto run_one = [&](Thread& t) {
      t_running = &t;
      g_thread = &t.st;
#if EMU_ASAN
      void* fake = nullptr;
      __sanitizer_start_switch_fiber(&fake, t.fiber.stack, kStackBytes);
#endif
      switch_context(t_sched, t.fiber.ctx);
#if EMU_ASAN
      __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
      if (t.run == Run::kDone) {
        ++done;
        thread_exited(b, t);
      }
    };
    if (!g_serial) {  // rounds: every runnable thread runs once, to its next synchronisation point
      while (done < n && b.error.empty()) {
        bool progressed = false;
        if (g_order == Order::kRandom) {
          for (int i = n - 1; i > 0; --i) std::swap(order[size_t(i)], order[size_t(next_random() % uint64_t(i + 1))]);
        }
        for (int oi = 0; oi < n && b.error.empty(); ++oi) {
          Thread& t = b.threads[size_t(order[size_t(oi)])];
          if (t.run != Run::kRunnable) continue;
          progressed = true;
          run_one(t);
        }
        if (!progressed && b.error.empty()) b.error = deadlock_report(b);
      }
    } else {  // serial: the first runnable thread from the order's start runs; a warp runs until it waits
      // Only a barrier's release or a collective of the running thread's warp makes threads runnable, so
      // the search restarts at the running warp unless a barrier released (forward and reverse: then the
      // found thread is still the lowest or highest runnable). serial-random starts from a random thread at
      // the block's start and after each release, so a random warp runs ahead to the next barrier.
      int last = -1;
      while (done < n && b.error.empty()) {
        int first = 0;
        if (g_order == Order::kRandom && (last < 0 || g_released)) {
          first = int(next_random() % uint64_t(n));
        } else if (g_order == Order::kRandom) {
          first = last / kWarp * kWarp;
        } else if (last >= 0 && !g_released) {
          first = g_order == Order::kReverse ? n - 1 - std::min(n - 1, (last / kWarp + 1) * kWarp - 1) : last / kWarp * kWarp;
        }
        g_released = false;
        int pick = -1;
        for (int k = 0; k < n; ++k) {
          const int i = g_order == Order::kReverse ? n - 1 - ((first + k) % n) : (first + k) % n;
          if (b.threads[size_t(i)].run == Run::kRunnable) {
            pick = i;
            break;
          }
        }
        last = pick;
        if (pick < 0) {
          b.error = deadlock_report(b);
          break;
        }
        run_one(b.threads[size_t(pick)]);
      }
    }
    std::free(smem);
    if (!b.error.empty()) {
      for (int i = 0; i < n; ++i) g_stack_dirty[size_t(i)] = b.threads[size_t(i)].run != Run::kDone;
      t_block = saved_block;
      t_running = saved_running;
      g_thread = saved_thread;
      std::string msg = "cuda_on_cpu: " + b.error + "\n  (launched at " + where(cfg.file, cfg.line) +
                        (g_order == Order::kForward ? std::string(")") : "; schedule " + g_schedule + ")");
      std::fprintf(stderr, "%s\n", msg.c_str());
      if (g_verbose_errors) std::abort();
      throw std::runtime_error(msg);
    }
  }
  t_block = saved_block;
  t_running = saved_running;
  g_thread = saved_thread;
}

cudaError_t last_error_and_clear() {
  const cudaError_t e = g_last_error;
  g_last_error = cudaSuccess;
  return e;
}

cudaError_t peek_last_error() { return g_last_error; }

}  // namespace emu
