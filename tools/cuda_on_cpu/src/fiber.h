// Minimal fibers: a context is a saved stack pointer. On x86-64 the switch is a few instructions
// (callee-saved registers, the x87 control word and MXCSR); elsewhere it falls back to ucontext
// (correct, slower: swapcontext makes a system call per switch).
#pragma once

#include <cstddef>

#if defined(__x86_64__)
#define EMU_FIBER_ASM 1
#else
#define EMU_FIBER_ASM 0
#include <ucontext.h>
#endif

namespace emu {

struct Context {
#if EMU_FIBER_ASM
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

// Prepares `ctx` to run `entry()` on the stack [stack, stack + bytes) at the next switch into it.
// `entry` must never return (it switches away for the last time instead).
void make_context(Context& ctx, char* stack, size_t bytes, void (*entry)());

// Saves the running context in `from` and resumes `to`.
void switch_context(Context& from, Context& to);

}  // namespace emu
