/* fake_libcuda.c - the CUDA driver calls ecx.cuda.Driver makes, with their
 * names and C signatures, over a table of registered ranges, for tests on
 * machines without a GPU (test_cuda.py builds it with cc and loads it
 * through the same ctypes code as libcuda.so.1). Globals named fake_*
 * steer it and count calls; `fake_log` lists the calls in order, one
 * letter each (R register, U unregister, S synchronize, P push, p pop). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define SUCCESS 0
#define INVALID_VALUE 1
#define INVALID_CONTEXT 201
#define ALREADY_REGISTERED 712
#define NOT_REGISTERED 713

int fake_force_register;    /* nonzero: cuMemHostRegister returns it */
uintptr_t fake_current_ctx; /* the thread's context (0: none) */
int fake_registers, fake_unregisters, fake_syncs, fake_retained, fake_pushed;
unsigned fake_last_flags;
char fake_log[256];

static struct {
	uintptr_t base;
	size_t n;
	unsigned flags;
} regs[16];
static int nregs;
static uintptr_t pushed_ctx;

static void log_call(char c)
{
	size_t n = strlen(fake_log);
	if (n + 1 < sizeof(fake_log))
		fake_log[n] = c;
}

static uintptr_t current(void)
{
	return pushed_ctx ? pushed_ctx : fake_current_ctx;
}

int cuInit(unsigned flags)
{
	(void)flags;
	return SUCCESS;
}

int cuGetErrorName(int rc, const char **name)
{
	switch (rc) {
	case SUCCESS:
		*name = "CUDA_SUCCESS";
		return SUCCESS;
	case 2:
		*name = "CUDA_ERROR_OUT_OF_MEMORY";
		return SUCCESS;
	case INVALID_CONTEXT:
		*name = "CUDA_ERROR_INVALID_CONTEXT";
		return SUCCESS;
	case ALREADY_REGISTERED:
		*name = "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
		return SUCCESS;
	case NOT_REGISTERED:
		*name = "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
		return SUCCESS;
	default:
		*name = NULL;
		return INVALID_VALUE;
	}
}

int cuDeviceGet(int *dev, int ordinal)
{
	if (ordinal < 0 || ordinal > 7)
		return INVALID_VALUE;
	*dev = ordinal;
	return SUCCESS;
}

int cuCtxGetCurrent(void **ctx)
{
	*ctx = (void *)current();
	return SUCCESS;
}

int cuDevicePrimaryCtxRetain(void **ctx, int dev)
{
	fake_retained++;
	*ctx = (void *)(uintptr_t)(0x1000 + dev);
	return SUCCESS;
}

int cuDevicePrimaryCtxRelease_v2(int dev)
{
	(void)dev;
	fake_retained--;
	return SUCCESS;
}

int cuCtxPushCurrent_v2(void *ctx)
{
	log_call('P');
	fake_pushed++;
	pushed_ctx = (uintptr_t)ctx;
	return SUCCESS;
}

int cuCtxPopCurrent_v2(void **ctx)
{
	log_call('p');
	fake_pushed--;
	if (ctx != NULL)
		*ctx = (void *)pushed_ctx;
	pushed_ctx = 0;
	return SUCCESS;
}

int cuCtxSynchronize(void)
{
	if (!current())
		return INVALID_CONTEXT;
	log_call('S');
	fake_syncs++;
	return SUCCESS;
}

static int find(uintptr_t a)
{
	for (int i = 0; i < nregs; i++)
		if (a >= regs[i].base && a < regs[i].base + regs[i].n)
			return i;
	return -1;
}

/* What UCX's cuda_copy does to memory it maps: tests call it to stand for
 * a registration that is not ecx's. */
int fake_preregister(void *p, size_t n)
{
	if (nregs == 16)
		return -1;
	regs[nregs].base = (uintptr_t)p;
	regs[nregs].n = n;
	regs[nregs].flags = 1;
	nregs++;
	return 0;
}

int cuMemHostRegister_v2(void *p, size_t n, unsigned flags)
{
	log_call('R');
	fake_registers++;
	fake_last_flags = flags;
	if (!current())
		return INVALID_CONTEXT;
	if (fake_force_register)
		return fake_force_register;
	uintptr_t a = (uintptr_t)p;
	if (n == 0)
		return INVALID_VALUE;
	if (find(a) >= 0 || find(a + n - 1) >= 0)
		return ALREADY_REGISTERED;
	if (fake_preregister(p, n) != 0)
		return 2;
	regs[nregs - 1].flags = flags;
	return SUCCESS;
}

int cuMemHostUnregister(void *p)
{
	log_call('U');
	fake_unregisters++;
	if (!current())
		return INVALID_CONTEXT;
	for (int i = 0; i < nregs; i++) {
		if (regs[i].base == (uintptr_t)p) {
			regs[i] = regs[--nregs];
			return SUCCESS;
		}
	}
	return NOT_REGISTERED;
}

int cuMemHostGetFlags(unsigned *flags, void *p)
{
	if (!current())
		return INVALID_CONTEXT;
	int i = find((uintptr_t)p);
	if (i < 0)
		return INVALID_VALUE;
	*flags = regs[i].flags;
	return SUCCESS;
}

/* Whether [p, p + n) is one registered range (1) or not (0). */
int fake_registered(void *p, size_t n)
{
	int i = find((uintptr_t)p);
	return i >= 0 && regs[i].base == (uintptr_t)p && regs[i].n == n;
}

/* Forgets every registration and call (each test starts from here). */
void fake_reset(void)
{
	nregs = 0;
	pushed_ctx = 0;
	fake_force_register = 0;
	fake_current_ctx = 1;
	fake_registers = fake_unregisters = fake_syncs = 0;
	fake_retained = fake_pushed = 0;
	fake_last_flags = 0;
	memset(fake_log, 0, sizeof(fake_log));
}
