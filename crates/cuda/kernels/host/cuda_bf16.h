// Host stand-in for NVIDIA's cuda_bf16.h: the emulator's __nv_bfloat16 (see ../emulate.h).
#include "../emulate.h"
