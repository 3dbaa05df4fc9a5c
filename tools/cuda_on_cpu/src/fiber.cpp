#include "fiber.h"

#include <cstdint>

#if EMU_FIBER_ASM
extern "C" void emu_switch_stack(void** save_sp, void* new_sp);

// Pushes the callee-saved registers and the FP control state, swaps stack pointers, pops them back.
asm(R"(
  .text
  .p2align 4
  .globl emu_switch_stack
  .type emu_switch_stack, @function
emu_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch_stack, .-emu_switch_stack
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

namespace emu {

#if EMU_FIBER_ASM
void make_context(Context& ctx, char* stack, size_t bytes, void (*entry)()) {
  // Top of the stack, 16-byte aligned, then: [fake return address] [entry] [rbp rbx r12..r15] [fp state].
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t(15);
  auto* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                    // entry's return address slot: rsp % 16 == 8 on entry
  *--sp = reinterpret_cast<uint64_t>(entry);    // popped by `ret`
  for (int i = 0; i < 6; ++i) *--sp = 0;        // rbp, rbx, r12, r13, r14, r15
  uint32_t mxcsr;
  uint16_t fpcw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpcw));
  *--sp = mxcsr;                                // 8(%rsp)
  *--sp = fpcw;                                 // (%rsp)
  ctx.sp = sp;
}

void switch_context(Context& from, Context& to) { emu_switch_stack(&from.sp, to.sp); }
#else
void make_context(Context& ctx, char* stack, size_t bytes, void (*entry)()) {
  static ucontext_t templ = [] {
    ucontext_t c;
    getcontext(&c);
    return c;
  }();
  ctx.uc = templ;
  ctx.uc.uc_stack.ss_sp = stack;
  ctx.uc.uc_stack.ss_size = bytes;
  ctx.uc.uc_link = nullptr;
  makecontext(&ctx.uc, entry, 0);
}

void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

}  // namespace emu
