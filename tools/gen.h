/* gen.h - synthetic encoder outputs for serve, demo and bench: the bytes
 * of an item depend only on its id, so any process can verify them. */
#ifndef ECX_TOOL_GEN_H
#define ECX_TOOL_GEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Fills n bytes from a generator seeded by id. */
void gen_fill(const char *id, void *buf, size_t n);

/* True when buf holds what gen_fill(id) writes. */
bool gen_check(const char *id, const void *buf, size_t n);

/* Token counts of Qwen2.5-VL images at common sizes (width 3584, bf16):
 * i picks one of them, cycling. */
uint64_t gen_qwen_tokens(size_t i);

#endif
