// The traced program of tests/test_return_probe_safety.py: calls the waits of
// throwing_lib.cpp (its stand-in libtorch_cpu.so), half of them failing, and
// catches every exception, as a training job that retries a collective would.
// Prints "ready", waits for a line on stdin (the test attaches its tracers
// then), runs the rounds and prints one summary line. Exit status 0 unless a
// result is wrong.
//
// Usage: prog ROUNDS [GPU_STUB_DIR]. With the directory of the GPU stand-ins
// (src/fleetscope/eval/gpu_stub), it also dlopens their libcudart and libnccl
// and calls one CUDA and two NCCL functions per round, so the CUDA and NCCL
// tracers attach to it as well.
#include <dlfcn.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>

#include "throwing_api.h"

extern "C" c10d::Work* fleetscope_test_new_work();

typedef int (*no_arg_fn)(void);

static no_arg_fn stub_function(const std::string& dir, const char* lib, const char* name) {
  void* h = dlopen((dir + "/" + lib).c_str(), RTLD_NOW);
  if (!h) { std::cerr << dlerror() << std::endl; std::exit(3); }
  no_arg_fn fn = reinterpret_cast<no_arg_fn>(dlsym(h, name));
  if (!fn) { std::cerr << dlerror() << std::endl; std::exit(3); }
  return fn;
}

int main(int argc, char** argv) {
  int rounds = argc > 1 ? std::stoi(argv[1]) : 20;
  no_arg_fn gpu_calls[3] = {nullptr, nullptr, nullptr};
  if (argc > 2) {
    gpu_calls[0] = stub_function(argv[2], "libcudart.so.12", "cudaDeviceSynchronize");
    gpu_calls[1] = stub_function(argv[2], "libnccl.so.2", "ncclGroupStart");
    gpu_calls[2] = stub_function(argv[2], "libnccl.so.2", "ncclGroupEnd");
  }
  std::cout << "ready" << std::endl;
  std::string line;
  std::getline(std::cin, line);
  gloo::transport::tcp::UnboundBuffer buf;
  c10d::Work* work = fleetscope_test_new_work();
  long ok = 0, caught = 0, ranks = 0, gpu_rc = 0;
  for (int i = 0; i < rounds; ++i) {
    for (no_arg_fn fn : gpu_calls)
      if (fn) gpu_rc += fn();
    std::chrono::milliseconds t(i % 2 ? -1 : 100);  // odd rounds time out
    int rank = 0;
    try { ok += buf.waitRecv(&rank, t); ranks += rank; } catch (const std::runtime_error&) { ++caught; }
    try { ok += buf.waitSend(&rank, t); ranks += rank; } catch (const std::runtime_error&) { ++caught; }
    try { ok += work->wait(t); } catch (const std::runtime_error&) { ++caught; }
  }
  delete work;
  std::cout << "ok=" << ok << " caught=" << caught << " ranks=" << ranks << " gpu_rc=" << gpu_rc << std::endl;
  long expect_ok = 3L * ((rounds + 1) / 2), expect_caught = 3L * (rounds / 2);
  return ok == expect_ok && caught == expect_caught ? 0 : 1;
}
