// The Tested Transformer: every figure of a notebook cell opens full size on a click or tap
// (on a phone the column shrinks it to the screen's width). The image is wrapped in a link to
// itself, which a keyboard can reach and a screen reader announces.
document.addEventListener("DOMContentLoaded", () => {
  for (const img of document.querySelectorAll("div.cell_output img")) {
    if (img.closest("a")) continue;
    const link = document.createElement("a");
    link.href = img.getAttribute("src");
    link.className = "tt-full-size";
    const alt = (img.getAttribute("alt") || "").trim();
    link.setAttribute("aria-label", `Open the figure full size${alt ? ": " + alt : ""}`);
    img.replaceWith(link);
    link.appendChild(img);
  }
});

// The sidebar (☰) and "Contents" buttons. The two themes of the book each bind their handler
// to the first button of its kind on the page (`document.querySelector`), and since
// pydata-sphinx-theme 0.17 the first one is a copy in the top bar that sphinx-book-theme hides,
// so the button the reader sees does nothing (pydata-sphinx-theme issue 2451). Every other
// button of a kind hands its click to the first, whose handlers then open the drawer (narrow
// screens) or fold the sidebar away (wide ones). A keyboard's Enter or Space is a click too.
document.addEventListener("DOMContentLoaded", () => {
  for (const kind of [".primary-toggle", ".secondary-toggle"]) {
    const [bound, ...others] = document.querySelectorAll(kind);
    for (const button of others) {
      button.addEventListener("click", (event) => {
        event.preventDefault();
        event.stopPropagation();
        bound.click();
        // As the theme does for the button it binds: a pointer's click leaves no focus behind
        // (its tooltip would stay up); a key press keeps it, for the keyboard's sake.
        if (event.detail > 0) button.blur();
      });
    }
  }
});
