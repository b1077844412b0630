// A module with a thread-local variable of its own, loaded with dlopen by leak_check_dynamic_tls_test: its
// first use in a thread makes glibc allocate the thread's block of this module's TLS on the heap
// (__tls_get_addr), as OpenMPI's and CUDA's plugins do in every program of the suite.
namespace {
thread_local int uses = 0;
}

extern "C" int touch_dynamic_tls() {
  return ++uses;
}
