/*
 * registry.c - the public entry points of the registry server
 * (ecx_registry_create, _port, _destroy): each one call into registry/
 * (server.c), which reports a failure of create in why.
 */
#include "registry/server.h"

int ecx_registry_create(const ecx_registry_params *params, ecx_registry **out,
                        char *why, size_t whylen)
{
	return reg_server_create(params, false, out, why, whylen);
}

uint16_t ecx_registry_port(const ecx_registry *r)
{
	return reg_server_port(r);
}

void ecx_registry_destroy(ecx_registry *r)
{
	reg_server_destroy(r);
}
