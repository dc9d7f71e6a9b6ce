// titan_ext delegate data plane: pinned shared-memory slot rings and signal flags.
//
// A Region is one POSIX shared-memory segment mapped into this process. The training process
// creates it (shm_open O_CREAT|O_EXCL, mode 0600, a unique name), and the name is unlinked before
// create() returns: the delegate process attaches through the inherited file descriptor, so no
// name of ours outlives a crash. Flags are 32-bit words inside the segment, written with release
// and read with acquire semantics; waiters spin briefly, then sleep on a process-shared futex.
// Slot payloads are exposed as zero-copy uint8 tensors (torch::from_blob) that keep the mapping
// alive. CUDA parts (cudaHostRegister, async copy + signal) are compiled only WITH_CUDA.
#include <torch/extension.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifdef WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include "delegate_cuda.h"
#include "capture_mode.h"
#endif

namespace {

std::string errno_text(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

long futex(uint32_t* addr, int op, uint32_t val, const struct timespec* ts) {
  // Shared (non-private) futex: the word lives in a mapping shared by two processes.
  return syscall(SYS_futex, addr, op, val, ts, nullptr, 0);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Region : std::enable_shared_from_this<Region> {
  uint8_t* base = nullptr;
  size_t size = 0;
  int fd = -1;
  std::string name;
  bool cuda_registered = false;

  ~Region() {
#ifdef WITH_CUDA
    if (cuda_registered) cudaHostUnregister(base);
#endif
    if (base) munmap(base, size);
    if (fd >= 0) close(fd);
  }

  void check(int64_t off, int64_t n) const {
    if (off < 0 || n < 0 || static_cast<size_t>(off + n) > size)
      throw std::out_of_range("offset " + std::to_string(off) + "+" + std::to_string(n) +
                              " outside region of " + std::to_string(size) + " bytes");
  }
  std::atomic<uint32_t>* word(int64_t off) const {
    check(off, 4);
    if (off % 4) throw std::invalid_argument("flag offset must be 4-byte aligned");
    return reinterpret_cast<std::atomic<uint32_t>*>(base + off);
  }
  std::atomic<int64_t>* word64(int64_t off) const {
    check(off, 8);
    if (off % 8) throw std::invalid_argument("counter offset must be 8-byte aligned");
    return reinterpret_cast<std::atomic<int64_t>*>(base + off);
  }
};

std::shared_ptr<Region> map_fd(int fd, size_t size, std::string name) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw std::runtime_error(errno_text("mmap"));
  auto r = std::make_shared<Region>();
  r->base = static_cast<uint8_t*>(p);
  r->size = size;
  r->fd = fd;
  r->name = std::move(name);
  return r;
}

// Create a fresh segment: unique name "/<prefix>_<pid>_<random>", mode 0600, exclusive.
// The name is unlinked before returning unless keep_name (tests of the sweeper only).
std::shared_ptr<Region> region_create(size_t size, const std::string& prefix, bool keep_name) {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  uint64_t salt = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ counter.fetch_add(1);
  char buf[128];
  std::snprintf(buf, sizeof(buf), "/%s_%d_%016llx", prefix.c_str(), static_cast<int>(getpid()),
                static_cast<unsigned long long>(salt));
  std::string name(buf);
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error(errno_text(("shm_open " + name).c_str()));
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int e = errno;
    shm_unlink(name.c_str());
    close(fd);
    errno = e;
    throw std::runtime_error(errno_text("ftruncate"));
  }
  std::shared_ptr<Region> r;
  try {
    r = map_fd(fd, size, name);
  } catch (...) {
    shm_unlink(name.c_str());
    close(fd);
    throw;
  }
  if (!keep_name) shm_unlink(name.c_str());
  return r;
}

std::shared_ptr<Region> region_attach(int fd, size_t size) {
  struct stat st;
  if (fstat(fd, &st) != 0) throw std::runtime_error(errno_text("fstat"));
  if (static_cast<size_t>(st.st_size) < size)
    throw std::runtime_error("shared-memory segment is smaller than expected");
  int own = dup(fd);
  if (own < 0) throw std::runtime_error(errno_text("dup"));
  return map_fd(own, size, "");
}

uint32_t load_u32(const Region& r, int64_t off) { return r.word(off)->load(std::memory_order_acquire); }

void store_u32(const Region& r, int64_t off, uint32_t v, bool wake) {
  auto* w = r.word(off);
  w->store(v, std::memory_order_release);
  if (wake) futex(reinterpret_cast<uint32_t*>(w), FUTEX_WAKE, INT32_MAX, nullptr);
}

bool cas_u32(const Region& r, int64_t off, uint32_t expected, uint32_t desired) {
  return r.word(off)->compare_exchange_strong(expected, desired, std::memory_order_acq_rel,
                                              std::memory_order_acquire);
}

// Wait until the word at `off` equals `want`. Returns 0 when it does, 1 on timeout, 2 when the
// word at `abort_off` (if >= 0) became non-zero. Spins, then sleeps on the futex in slices of at
// most max_sleep_us (a word written by the GPU wakes nobody, so slices bound the latency).
int wait_u32(const Region& r, int64_t off, uint32_t want, double timeout_s, int64_t abort_off,
             int64_t max_sleep_us) {
  auto* w = r.word(off);
  std::atomic<uint32_t>* ab = abort_off >= 0 ? r.word(abort_off) : nullptr;
  for (int i = 0; i < 4000; ++i) {
    if (w->load(std::memory_order_acquire) == want) return 0;
    cpu_relax();
  }
  const double deadline = timeout_s >= 0 ? now_s() + timeout_s : 0;
  while (true) {
    uint32_t cur = w->load(std::memory_order_acquire);
    if (cur == want) return 0;
    if (ab && ab->load(std::memory_order_acquire) != 0) return 2;
    if (timeout_s >= 0 && now_s() >= deadline) return 1;
    struct timespec ts;
    ts.tv_sec = max_sleep_us / 1000000;
    ts.tv_nsec = (max_sleep_us % 1000000) * 1000;
    futex(reinterpret_cast<uint32_t*>(w), FUTEX_WAIT, cur, &ts);
  }
}

int64_t load_i64(const Region& r, int64_t off) { return r.word64(off)->load(std::memory_order_acquire); }
void store_i64(const Region& r, int64_t off, int64_t v) { r.word64(off)->store(v, std::memory_order_release); }
int64_t add_i64(const Region& r, int64_t off, int64_t v) {
  return r.word64(off)->fetch_add(v, std::memory_order_acq_rel) + v;
}

torch::Tensor region_tensor(const std::shared_ptr<Region>& r, int64_t off, int64_t nbytes) {
  r->check(off, nbytes);
  std::shared_ptr<Region> keep = r;  // the mapping lives as long as any view of it
  return torch::from_blob(
      r->base + off, {nbytes}, [keep](void*) mutable { keep.reset(); },
      torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCPU));
}

void set_parent_death_signal(int sig) {
  if (prctl(PR_SET_PDEATHSIG, sig) != 0) throw std::runtime_error(errno_text("prctl"));
}

bool cuda_compiled() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

#ifdef WITH_CUDA
void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void cuda_register(Region& r) {
  if (r.cuda_registered) return;
  check_cuda(cudaHostRegister(r.base, r.size, cudaHostRegisterPortable | cudaHostRegisterMapped),
             "cudaHostRegister");
  r.cuda_registered = true;
}

uint32_t* device_flag_ptr(Region& r, int64_t off) {
  r.word(off);
  if (!r.cuda_registered) throw std::runtime_error("region is not cudaHostRegister'ed");
  void* dptr = nullptr;
  check_cuda(cudaHostGetDevicePointer(&dptr, r.base + off, 0), "cudaHostGetDevicePointer");
  return static_cast<uint32_t*>(dptr);
}

// Async D2H of a contiguous CUDA tensor into the region at data_off, then (same stream) a kernel
// that writes `value` to the host flag at flag_off with a system-scope release. Never blocks the host.
// Bound as a method of Region, so the Region comes first (Python: region.d2h_signal(src, ...)).
void d2h_signal(Region& r, const torch::Tensor& src, int64_t data_off, int64_t flag_off, uint32_t value) {
  TORCH_CHECK(src.is_cuda() && src.is_contiguous(), "d2h_signal needs a contiguous CUDA tensor");
  const int64_t n = src.numel() * src.element_size();
  r.check(data_off, n);
  auto stream = c10::cuda::getCurrentCUDAStream(src.device().index());
  check_cuda(titanx_copy_and_signal(r.base + data_off, src.data_ptr(), n, cudaMemcpyDeviceToHost,
                                    device_flag_ptr(r, flag_off), value, nullptr, 0, stream.stream()),
             "d2h_signal");
}

// Async H2D from the region into a contiguous CUDA tensor, then (same stream) a kernel that writes
// dev_value into dev_flag (int32 CUDA tensor, device-scope release) and host_value into the host
// flag at host_flag_off (system-scope release; tells the host the slot may be reused).
void h2d_signal(Region& r, int64_t data_off, const torch::Tensor& dst, int64_t host_flag_off,
                uint32_t host_value, const torch::Tensor& dev_flag, uint32_t dev_value) {
  TORCH_CHECK(dst.is_cuda() && dst.is_contiguous(), "h2d_signal needs a contiguous CUDA tensor");
  TORCH_CHECK(dev_flag.is_cuda() && dev_flag.scalar_type() == torch::kInt32, "dev_flag: int32 CUDA tensor");
  const int64_t n = dst.numel() * dst.element_size();
  r.check(data_off, n);
  auto stream = c10::cuda::getCurrentCUDAStream(dst.device().index());
  check_cuda(titanx_copy_and_signal(dst.data_ptr(), r.base + data_off, n, cudaMemcpyHostToDevice,
                                    device_flag_ptr(r, host_flag_off), host_value,
                                    static_cast<uint32_t*>(dev_flag.data_ptr()), dev_value, stream.stream()),
             "h2d_signal");
}

// Make the current stream wait (on the device) until dev_flag[0] == value.
void stream_wait_flag(const torch::Tensor& dev_flag, uint32_t value) {
  TORCH_CHECK(dev_flag.is_cuda() && dev_flag.scalar_type() == torch::kInt32, "dev_flag: int32 CUDA tensor");
  auto stream = c10::cuda::getCurrentCUDAStream(dev_flag.device().index());
  check_cuda(titanx_stream_wait_flag(static_cast<uint32_t*>(dev_flag.data_ptr()), value, stream.stream()),
             "stream_wait_flag");
}

// The calling thread's CUDA-graph capture mode set to `mode`; returns the previous one (capture_mode.cu;
// titan_ext.runtime.device._capture_mode_guard: side-thread queries in thread-local mode).
int64_t capture_mode_exchange(int64_t mode) {
  auto m = static_cast<cudaStreamCaptureMode>(mode);
  check_cuda(titanx_capture_mode_exchange(&m), "cudaThreadExchangeStreamCaptureMode");
  return static_cast<int64_t>(m);
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "titan_ext delegate data plane: shared-memory slot rings, flags, async copy+signal";
  py::class_<Region, std::shared_ptr<Region>>(m, "Region")
      .def_static("create", &region_create, py::arg("size"), py::arg("prefix") = "titanx",
                  py::arg("keep_name") = false)
      .def_static("attach", &region_attach, py::arg("fd"), py::arg("size"))
      .def_property_readonly("fd", [](const Region& r) { return r.fd; })
      .def_property_readonly("size", [](const Region& r) { return r.size; })
      .def_property_readonly("name", [](const Region& r) { return r.name; })
      .def_property_readonly("address", [](const Region& r) { return reinterpret_cast<uintptr_t>(r.base); })
      .def_property_readonly("cuda_registered", [](const Region& r) { return r.cuda_registered; })
      .def("load", &load_u32, py::arg("off"))
      .def("store", &store_u32, py::arg("off"), py::arg("value"), py::arg("wake") = true)
      .def("cas", &cas_u32, py::arg("off"), py::arg("expected"), py::arg("desired"))
      .def("wait", &wait_u32, py::arg("off"), py::arg("want"), py::arg("timeout_s") = -1.0,
           py::arg("abort_off") = -1, py::arg("max_sleep_us") = 1000,
           py::call_guard<py::gil_scoped_release>())
      .def("load64", &load_i64, py::arg("off"))
      .def("store64", &store_i64, py::arg("off"), py::arg("value"))
      .def("add64", &add_i64, py::arg("off"), py::arg("value"))
      .def("tensor", &region_tensor, py::arg("off"), py::arg("nbytes"))
#ifdef WITH_CUDA
      .def("cuda_register", &cuda_register)
      .def("d2h_signal", &d2h_signal, py::arg("src"), py::arg("data_off"), py::arg("flag_off"),
           py::arg("value"))
      .def("h2d_signal", &h2d_signal, py::arg("data_off"), py::arg("dst"), py::arg("host_flag_off"),
           py::arg("host_value"), py::arg("dev_flag"), py::arg("dev_value"))
#endif
      ;
  m.def("set_parent_death_signal", &set_parent_death_signal, py::arg("sig"));
  m.def("cuda_compiled", &cuda_compiled);
#ifdef WITH_CUDA
  m.def("stream_wait_flag", &stream_wait_flag, py::arg("dev_flag"), py::arg("value"));
  m.def("capture_mode_exchange", &capture_mode_exchange, py::arg("mode"));
  m.attr("CAPTURE_MODE_THREAD_LOCAL") = static_cast<int64_t>(cudaStreamCaptureModeThreadLocal);
#endif
}
