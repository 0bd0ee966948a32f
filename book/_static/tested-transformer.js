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
