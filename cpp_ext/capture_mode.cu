// The calling thread's CUDA-graph capture mode. titan_ext's side threads (the PP watch,
// the arrival watchers, the delay stamper) query events and works that belong to the training thread,
// which may be capturing a CUDA graph. While any thread captures in the default global mode, a
// "potentially unsafe" call (an event query is one) from a thread that is itself in global mode is
// refused and invalidates that capture; a thread in cudaStreamCaptureModeThreadLocal is only held to
// its own captures. ProcessGroupNCCL's watchdog takes both guards before it queries a work ("allow
// watchdog to do an event query on a side thread": at::cuda::CUDAGuard on the work's device, then
// at::cuda::CUDAStreamCaptureModeGuard{cudaStreamCaptureModeThreadLocal}). No Python API sets the
// mode: titan_ext.runtime.device._capture_mode_guard enters it around side-thread device calls
// through the binding capture_mode_exchange (delegate_ext.cpp). Compiled in CUDA builds only.
#include "capture_mode.h"

extern "C" cudaError_t titanx_capture_mode_exchange(cudaStreamCaptureMode* mode) {
  return cudaThreadExchangeStreamCaptureMode(mode);
}
