// A real OpenID provider (the npm package oidc-provider) for tests/test_oidc.py, on 127.0.0.1.
// Usage: node provider.mjs NODE_DIR CONFIG.json
// CONFIG: {providers: [{port, issuer, keys: [private JWK, ...], alg}], clients: [{client_id, client_secret,
// groups, redirect_uris}], users: {login: groups}, audience}. A client with redirect_uris is a public client of
// the authorization-code flow (PKCE required); the others use client credentials. Any login signs in (devInteractions). The first key for an algorithm signs; later keys only verify (rotation).
// Resources: AUDIENCE (tokens for 300 s), AUDIENCE + ':short' (same audience, 1 s), anything else (its own aud).
import { readFileSync } from 'node:fs';
import { createServer } from 'node:http';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const [nodeDir, configPath] = process.argv.slice(2);
const { default: Provider } = await import(pathToFileURL(join(nodeDir, 'node_modules', 'oidc-provider', 'lib', 'index.js')));
const config = JSON.parse(readFileSync(configPath, 'utf8'));
const groups = Object.fromEntries(config.clients.map((c) => [c.client_id, c.groups || []]));
const users = config.users || {};

for (const spec of config.providers) {
  const provider = new Provider(spec.issuer, {
    jwks: { keys: spec.keys },
    cookies: { keys: ['test-cookie-key'] },
    clients: config.clients.map((c) => (c.redirect_uris ? {
      client_id: c.client_id, token_endpoint_auth_method: 'none', grant_types: ['authorization_code'],
      response_types: ['code'], redirect_uris: c.redirect_uris,
      post_logout_redirect_uris: c.post_logout_redirect_uris || [],
    } : {
      client_id: c.client_id, client_secret: c.client_secret, grant_types: ['client_credentials'],
      response_types: [], redirect_uris: [],
    })),
    features: {
      clientCredentials: { enabled: true },
      resourceIndicators: {
        enabled: true,
        defaultResource: async () => config.audience,
        useGrantedResource: async () => true,
        getResourceServerInfo: async (ctx, resource) => ({
          scope: 'api',
          audience: resource === `${config.audience}:short` ? config.audience : resource,
          accessTokenFormat: 'jwt',
          accessTokenTTL: resource === `${config.audience}:short` ? 1 : 300,
          jwt: { sign: { alg: spec.alg } },
        }),
      },
    },
    extraTokenClaims: async (ctx, token) => ({
      groups: token.accountId ? (users[token.accountId] || []) : (groups[token.clientId] || []),
    }),
    findAccount: async (ctx, sub) => ({ accountId: sub, claims: async () => ({ sub }) }),
  });
  await new Promise((resolve) => createServer(provider.callback()).listen(spec.port, '127.0.0.1', resolve));
}
console.log('ready');
