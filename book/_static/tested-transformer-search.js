// The Tested Transformer: the snippet under each search result is the prose around the words
// searched for. Sphinx's own snippet is the text of the whole page area from the first place
// that the *stemmed* word appears ("rotary" is looked for as "rotari", so never found): the
// download menu ("....ipynb"), the sidebar's headings and the raw LaTeX of formulas. Here the
// snippet comes from the article alone: the first paragraph, list item, caption or glossary
// entry that holds the whole query, else one of its words, else its stems; inline formulas
// are written as text (d_k, √d_k, L × L) or, when too complex, as "…"; display formulas,
// code outputs and navigation are left out. Loaded, deferred, on the search page only
// (book/_ext/tested_transformer_search.py): it replaces `Search.makeSearchSummary` after
// searchtools.js defines it and before the search starts.
(() => {
  if (typeof Search === "undefined") return;

  const LENGTH = 240; // characters of a snippet, as Sphinx shows
  const BEFORE = 80; // of them, before the word found
  // Never part of a snippet.
  const DROP = [
    ".headerlink", "script", "style", "nav", ".toctree-wrapper", ".prev-next-area",
    ".cell_output", "div.math", "mjx-container", "button", ".sd-tab-set > label",
  ].join(", ");
  // Blocks of prose, searched in the page's order; headings and code only when no prose holds
  // the word.
  const PROSE = "p, li, dt, dd, figcaption, th, td, .admonition-title";
  const OTHER = "h1, h2, h3, h4, h5, h6, pre";

  const SYMBOLS = {
    times: "×", cdot: "·", le: "≤", leq: "≤", ge: "≥", geq: "≥", ne: "≠", neq: "≠",
    in: "∈", infty: "∞", dots: "…", ldots: "…", cdots: "⋯", to: "→", rightarrow: "→",
    leftarrow: "←", approx: "≈", sim: "∼", pm: "±", sum: "Σ", prod: "Π", sqrt: "√",
    odot: "⊙", otimes: "⊗", oplus: "⊕", mid: "|", vert: "|", lvert: "|", rvert: "|",
    langle: "⟨", rangle: "⟩", ell: "ℓ", partial: "∂", nabla: "∇", propto: "∝",
    alpha: "α", beta: "β", gamma: "γ", delta: "δ", epsilon: "ε", varepsilon: "ε",
    eta: "η", theta: "θ", lambda: "λ", mu: "μ", pi: "π", rho: "ρ", sigma: "σ", tau: "τ",
    phi: "φ", varphi: "φ", omega: "ω", Delta: "Δ", Theta: "Θ", Sigma: "Σ", Omega: "Ω",
    exp: "exp", log: "log", max: "max", min: "min", sin: "sin", cos: "cos", arg: "arg",
    argmax: "argmax", quad: " ", qquad: " ", left: "", right: "", big: "", Big: "",
    displaystyle: "",
  };
  const SPACES = {
    ",": " ", ";": " ", ":": " ", "!": "", " ": " ", "{": "{", "}": "}", "|": "‖",
  };
  const WRAPPERS = new RegExp(
    "\\\\(?:mathrm|text|textrm|texttt|mathit|mathbf|mathsf|mathtt|boldsymbol|operatorname)" +
      "\\s*\\{([^{}]*)\\}",
    "g",
  );

  // An inline formula's TeX as text, or "…" when it uses what this does not know.
  const texToText = (tex) => {
    let t = tex.trim().replace(/^\\\(|\\\)$/g, "").trim();
    t = t.replace(WRAPPERS, "$1").replace(/\\mathbb\s*\{R\}/g, "ℝ");
    t = t.replace(/\^\s*\{?\\top\}?/g, "ᵀ").replace(/\^\s*\{?T\}?(?![a-zA-Z])/g, "ᵀ");
    t = t.replace(/\\sqrt\s*\{([^{}]*)\}/g, (_, x) => "√" + (/^\w+$/.test(x) ? x : `(${x})`));
    t = t.replace(/\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}/g, "$1/$2");
    t = t.replace(/\\([,;:! {}|])/g, (_, c) => SPACES[c]);
    t = t.replace(/\\([a-zA-Z]+)/g, (m, name) => (name in SYMBOLS ? SYMBOLS[name] : m));
    if (t.includes("\\")) return "…";
    return t.replace(/[{}]/g, "").replace(/\s+/g, " ").trim();
  };

  // The part of a fetched page that a result stands for, without what is never shown.
  const contentOf = (htmlString, anchor) => {
    const page = new DOMParser().parseFromString(htmlString, "text/html");
    const article =
      page.querySelector("article.bd-article") || page.querySelector('[role="main"]');
    if (!article) return null;
    let root = article;
    const target = anchor ? page.getElementById(decodeURIComponent(anchor.slice(1))) : null;
    if (target && article.contains(target)) {
      root = target;
      // A glossary term: one paragraph, the term and its definition.
      if (target.tagName === "DT") {
        const entry = page.createElement("p");
        entry.append(target.cloneNode(true), ": ");
        for (let dd = target.nextElementSibling; dd && dd.tagName === "DD";
          dd = dd.nextElementSibling) {
          // Its paragraphs' content, not the paragraphs: one block of prose.
          for (const node of [...dd.cloneNode(true).childNodes]) {
            entry.append(...(node.tagName === "P" ? [...node.childNodes, " "] : [node]));
          }
        }
        root = page.createElement("div");
        root.append(entry);
      }
    }
    root.querySelectorAll(DROP).forEach((el) => el.remove());
    root.querySelectorAll(".math").forEach((el) => el.replaceWith(texToText(el.textContent)));
    return root;
  };

  const flat = (el) => el.textContent.replace(/\s+/g, " ").trim();

  // Where `needle` starts a word of `text` (lower case), or -1.
  const wordAt = (text, needle) => {
    const escaped = needle.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
    const match = new RegExp(`(?<![\\p{L}\\p{N}_])${escaped}`, "u").exec(text);
    return match ? match.index : -1;
  };

  // The first block whose text holds one of the needles, tried in turn: prose first, then
  // headings and code, then the whole text; else the first paragraph of some length.
  const find = (root, needles) => {
    const prose = [...root.querySelectorAll(PROSE)].filter(
      // A list item or cell whose text is in paragraphs of its own is searched through those.
      (el) => !el.querySelector("p") && !el.closest("pre"),
    );
    const groups = [prose, [...root.querySelectorAll(OTHER)], [root]].map((els) =>
      els.map(flat).filter((t) => t));
    for (const blocks of groups) {
      for (const needle of needles) {
        for (const text of blocks) {
          const at = wordAt(text.toLowerCase(), needle);
          if (at > -1) return [text, at];
        }
      }
    }
    return [groups[0].find((t) => t.length > 40) || groups[2][0] || "", 0];
  };

  // About LENGTH characters of `text` around `at`, cut between words.
  const around = (text, at) => {
    if (text.length <= LENGTH) return text;
    let start = Math.max(0, at - BEFORE);
    if (start > 0) start = text.indexOf(" ", start) + 1 || start;
    let end = Math.min(text.length, start + LENGTH);
    const space = text.lastIndexOf(" ", end);
    if (end < text.length && space > start) end = space;
    const cut = text.slice(start, end).trim();
    return (start > 0 ? "… " : "") + cut + (end < text.length ? " …" : "");
  };

  const queryNeedles = (keywords) => {
    const query = new URLSearchParams(window.location.search).get("q") || "";
    const phrase = query.toLowerCase().trim();
    const words = splitQuery(phrase).filter((w) => w.length > 1 && !/^\d+$/.test(w));
    const needles = [phrase, ...words, ...[...keywords].map((k) => k.toLowerCase())];
    return [...new Set(needles.filter((n) => n))];
  };

  Search.makeSearchSummary = (htmlText, keywords, anchor) => {
    const root = contentOf(htmlText, anchor);
    if (!root) return null;
    const [text, at] = find(root, queryNeedles(keywords));
    if (!text) return null;
    const summary = document.createElement("p");
    summary.classList.add("context");
    summary.textContent = around(text, at);
    return summary;
  };
  // For the tests: the conversion of one formula.
  Search.texToText = texToText;
})();
